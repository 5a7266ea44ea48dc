from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("nodes", "0005_gpu_topology"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="protocol_version",
            field=models.CharField(blank=True, default="", max_length=16),
        ),
    ]
