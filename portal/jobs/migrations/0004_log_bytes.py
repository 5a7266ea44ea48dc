"""Job logs become bytes (a job may print NUL and invalid UTF-8) with a truncation marker."""
from django.db import migrations, models


def text_to_bytes(apps, schema_editor):
    Chunk = apps.get_model("jobs", "JobLogChunk")
    for pk, text in Chunk.objects.values_list("pk", "data_text").iterator():
        Chunk.objects.filter(pk=pk).update(data=text.encode("utf-8"))


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0003_notifications'),
    ]

    operations = [
        migrations.RenameField(model_name='joblogchunk', old_name='data', new_name='data_text'),
        migrations.AddField(model_name='joblogchunk', name='data', field=models.BinaryField(default=b'')),
        migrations.RunPython(text_to_bytes, migrations.RunPython.noop),
        migrations.RemoveField(model_name='joblogchunk', name='data_text'),
        migrations.AlterField(model_name='joblogchunk', name='data', field=models.BinaryField()),
        migrations.AddField(model_name='joblogchunk', name='marker', field=models.BooleanField(default=False)),
    ]
