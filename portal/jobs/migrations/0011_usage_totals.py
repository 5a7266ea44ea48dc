"""Running usage totals (docs/design.md section 10): budgets and fair share read small tables
instead of every allocation of the month. Existing released allocations start untallied; the
first scheduling pass folds them in."""
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("tenancy", "0001_initial"), ("jobs", "0010_job_checkpoint")]

    operations = [
        migrations.AddField(model_name="allocation", name="tallied", field=models.BooleanField(default=False)),
        migrations.AddIndex(model_name="allocation", index=models.Index(
            condition=models.Q(tallied=False), fields=["job"], name="allocation_untallied")),
        migrations.CreateModel(
            name="ProjectMonthUsage",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("month", models.DateField()),
                ("gpu_s", models.FloatField(default=0.0)),
                ("project", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="+",
                                              to="tenancy.project")),
            ],
            options={"constraints": [models.UniqueConstraint(fields=("project", "month"),
                                                             name="projectmonthusage_unique")]},
        ),
        migrations.CreateModel(
            name="ProjectFairshare",
            fields=[
                ("project", models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True,
                                                 related_name="+", serialize=False, to="tenancy.project")),
                ("half_life_s", models.FloatField()),
                ("decayed_gpu_s", models.FloatField(default=0.0)),
                ("as_of", models.DateTimeField()),
            ],
        ),
    ]
