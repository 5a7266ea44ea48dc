from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0009_job_placement_topology")]

    operations = [
        migrations.AddField(model_name="job", name="checkpoint_signal",
                            field=models.CharField(blank=True, max_length=8)),
        migrations.AddField(model_name="job", name="checkpoint_grace_s",
                            field=models.PositiveIntegerField(blank=True, null=True)),
        migrations.AddField(model_name="job", name="resume_after",
                            field=models.DateTimeField(blank=True, null=True)),
    ]
