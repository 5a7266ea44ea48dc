from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('nodes', '0007_datasets'),
    ]

    operations = [
        migrations.AddField(
            model_name='reaperstate',
            name='ingest_lag_s',
            field=models.FloatField(default=0.0),
        ),
        migrations.AddField(
            model_name='reaperstate',
            name='ingest_lag_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
