"""Sessions of attempts launched before per-attempt keys (0003): their node and app hold the session's
secret itself, so the proxy's per-attempt key would be refused, and one whose node reported before 0003
(gateway_attempt 0) answered 503, until the job restarted. Each such attempt keeps that secret as its
key (``legacy_key``), its report counts for it, and the session gets a new secret for its later attempts,
which the node that knows the old one cannot make."""
import secrets

from django.db import migrations, models
from django.db.migrations.recorder import MigrationRecorder
from django.db.models import Min
from django.utils import timezone

# Launch sent (jobs.models.HOLDING): its node was given the session's secret as it was at launch.
LAUNCHED = ("assigned", "starting", "running")


def keys_changed_at(connection):
    """When per-attempt keys came (0003 applied; now if it is being applied in this same run)."""
    applied = (MigrationRecorder(connection).migration_qs
               .filter(app="interactive", name="0003_session_gateway_attempt").values_list("applied", flat=True)
               .first())
    return applied or timezone.now()


def adopt_legacy_keys(apps, schema_editor):
    Session = apps.get_model("interactive", "Session")
    Allocation = apps.get_model("jobs", "Allocation")
    cutoff = keys_changed_at(schema_editor.connection)
    for s in (Session.objects.filter(job__state__in=LAUNCHED, legacy_key="").exclude(state="ended")
              .select_related("job")):
        job = s.job
        launched = (Allocation.objects.filter(job_id=job.pk, attempt=job.attempt)
                    .aggregate(t=Min("started_at"))["t"] or job.state_changed_at)
        if launched >= cutoff:
            continue  # launched with its per-attempt key
        fields = {"legacy_key": s.secret, "legacy_attempt": job.attempt, "secret": secrets.token_urlsafe(32)}
        if s.gateway_url and s.gateway_attempt == 0:
            fields["gateway_attempt"] = job.attempt  # reported before 0003, by this attempt's node
        Session.objects.filter(pk=s.pk).update(**fields)


class Migration(migrations.Migration):

    dependencies = [
        ("interactive", "0003_session_gateway_attempt"),
    ]

    operations = [
        migrations.AddField(model_name="session", name="legacy_key",
                            field=models.CharField(blank=True, max_length=64)),
        migrations.AddField(model_name="session", name="legacy_attempt",
                            field=models.PositiveIntegerField(default=0)),
        migrations.RunPython(adopt_legacy_keys, migrations.RunPython.noop),
    ]
