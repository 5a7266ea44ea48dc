"""GPU samples from heartbeats, and their 1-minute and 1-hour rollups (docs/design.md section 7).

Raw samples are written in batches (COPY on PostgreSQL) and kept METRICS_RAW_DAYS days;
charts read rollups, never raw rows. Billing does not read any of this: it meters allocations.
"""
from django.db import models


class GpuSample(models.Model):
    """One NVML reading of one GPU as the agent reported it."""

    id = models.BigAutoField(primary_key=True)
    # No foreign-key constraint: ingest must not lock GPU rows, and a GPU deleted later
    # leaves its samples to the pruner.
    gpu = models.ForeignKey("nodes.GPU", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+")
    ts = models.DateTimeField()
    utilization = models.FloatField()  # percent, 0..100
    memory_used_mb = models.IntegerField()
    memory_total_mb = models.IntegerField()
    temperature_c = models.FloatField()
    power_w = models.FloatField()
    ecc_errors = models.IntegerField(default=0)
    xid_errors = models.JSONField(default=list, blank=True)

    class Meta:
        indexes = [models.Index(fields=["ts"]), models.Index(fields=["gpu", "ts"])]


class Resolution(models.IntegerChoices):
    MINUTE = 60, "1 minute"
    HOUR = 3600, "1 hour"


class GpuRollup(models.Model):
    """A GPU's samples summarised over one bucket; upserted, so re-running a rollup is harmless."""

    gpu = models.ForeignKey("nodes.GPU", on_delete=models.CASCADE, related_name="+")
    resolution = models.IntegerField(choices=Resolution.choices)
    bucket = models.DateTimeField()  # start of the minute or hour (UTC)
    samples = models.IntegerField()
    util_avg = models.FloatField()
    util_max = models.FloatField()
    memory_used_avg_mb = models.FloatField()
    temperature_max_c = models.FloatField()
    power_avg_w = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu", "resolution", "bucket"], name="gpurollup_unique")]
        indexes = [models.Index(fields=["resolution", "bucket"])]


class FleetRollup(models.Model):
    """The whole fleet over one bucket: what the console's time-series charts draw.

    allocated_gpus is the time-weighted sum of allocation fractions (from Allocations, exact);
    used_gpus is the sum of GPUs' mean utilization (from samples); queue figures are taken
    when the bucket is rolled up.
    """

    resolution = models.IntegerField(choices=Resolution.choices)
    bucket = models.DateTimeField()
    gpus = models.IntegerField()
    allocated_gpus = models.FloatField()
    used_gpus = models.FloatField()
    queued_jobs = models.IntegerField()
    started_jobs = models.IntegerField()
    wait_avg_s = models.FloatField(null=True)

    class Meta:
        ordering = ["bucket"]
        constraints = [models.UniqueConstraint(fields=["resolution", "bucket"], name="fleetrollup_unique")]
