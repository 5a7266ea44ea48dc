"""Jobs say how many nodes they may span (resources.nodes); existing jobs keep to one."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0004_log_bytes'),
    ]

    operations = [
        migrations.AddField(model_name='job', name='nodes', field=models.PositiveSmallIntegerField(default=1)),
    ]
