
import django.db.models.deletion
import portal.interactive.models
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('jobs', '0009_job_placement_topology'),
        ('tenancy', '0002_idle_detection'),
    ]

    operations = [
        migrations.CreateModel(
            name='SessionPolicy',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('idle_timeout_s', models.PositiveIntegerField(help_text="Stop a session's job after this long without traffic (0: never).")),
                ('max_lifetime_s', models.PositiveIntegerField(help_text="Stop a session's job this long after it started (0: only its time limit).")),
                ('project', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='session_policy', to='tenancy.project')),
            ],
        ),
        migrations.CreateModel(
            name='Session',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=32)),
                ('port', models.PositiveIntegerField(blank=True, null=True)),
                ('kind', models.CharField(choices=[('jupyter', 'JupyterLab'), ('http', 'HTTP app'), ('terminal', 'Terminal')], max_length=10)),
                ('state', models.CharField(choices=[('starting', 'Starting'), ('running', 'Running'), ('idle', 'Idle'), ('ended', 'Ended')], default='starting', max_length=10)),
                ('secret', models.CharField(default=portal.interactive.models.new_secret, max_length=64)),
                ('share', models.CharField(choices=[('owner', 'owner'), ('project', 'project')], default='owner', max_length=8)),
                ('gateway_url', models.CharField(blank=True, max_length=300)),
                ('message', models.CharField(blank=True, max_length=300)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('running_at', models.DateTimeField(blank=True, null=True)),
                ('last_activity_at', models.DateTimeField(blank=True, null=True)),
                ('warned_at', models.DateTimeField(blank=True, null=True)),
                ('ended_at', models.DateTimeField(blank=True, null=True)),
                ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='sessions', to='jobs.job')),
            ],
            options={
                'ordering': ['job_id', 'name'],
                'indexes': [models.Index(fields=['state'], name='interactive_state_e7e0ef_idx')],
                'constraints': [models.UniqueConstraint(fields=('job', 'name'), name='session_unique_job_name')],
            },
        ),
    ]
