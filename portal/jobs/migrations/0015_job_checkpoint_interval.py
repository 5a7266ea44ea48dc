from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0014_job_avoid_nodes'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='checkpoint_interval_s',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
