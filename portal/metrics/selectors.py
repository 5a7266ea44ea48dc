"""Reads of GPU and fleet rollups over a time range, for the console's charts and heat map.

A range reads minute rollups when it is short (1 h, 24 h: at most 1,440 rows a series) and hourly
rollups when it is long (7 d, 30 d), and in the hourly case the hours not yet complete come from
minute rows: an hourly row of the current hour averages over the whole hour, so an 8-GPU job
started five minutes ago would show as 0.7 GPUs until the hour ends.
"""
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db.models import Count, F, Max, Sum
from django.utils import timezone

from portal.jobs.models import Allocation, JobState

from .models import FleetRollup, GpuRollup, Resolution

FLEET_FIELDS = ("bucket", "resolution", "gpus", "allocated_gpus", "used_gpus", "queued_jobs", "started_jobs",
                "wait_avg_s")


@dataclass(frozen=True)
class TimeRange:
    key: str  # as in the page's ?range=
    label: str
    span: timedelta
    resolution: int  # Resolution of the rollups that cover it


RANGES = {r.key: r for r in (
    TimeRange("1h", "1 hour", timedelta(hours=1), Resolution.MINUTE),
    TimeRange("24h", "24 hours", timedelta(hours=24), Resolution.MINUTE),
    TimeRange("7d", "7 days", timedelta(days=7), Resolution.HOUR),
    TimeRange("30d", "30 days", timedelta(days=30), Resolution.HOUR),
)}
DEFAULT_RANGE = "24h"


def _hour_floor(dt: datetime) -> datetime:
    return dt.astimezone(dt_timezone.utc).replace(minute=0, second=0, microsecond=0)


def _minutes_from(*, start: datetime, now: datetime, resolution: int, hourly_model) -> datetime:
    """Where minute rows take over from hourly ones: `start` for a minute range; for an hourly range
    the end of the last hour with an hourly row, and never later than the current hour's start.
    With no hourly row in the range at all (rollup_hours has not run), minutes cover it all."""
    if resolution == Resolution.MINUTE:
        return start
    latest = hourly_model.objects.filter(resolution=Resolution.HOUR, bucket__gte=start).aggregate(b=Max("bucket"))["b"]
    if latest is None:
        return start
    return min(_hour_floor(now), latest + timedelta(hours=1))


def fleet_range(*, time_range: TimeRange, now: datetime | None = None) -> list[dict]:
    """Fleet rows over the range, oldest first: hourly rows then minute rows (see the module docstring)."""
    now = now or timezone.now()
    start = now - time_range.span
    cut = _minutes_from(start=start, now=now, resolution=time_range.resolution, hourly_model=FleetRollup)
    hours = []
    if cut > start:
        hours = list(FleetRollup.objects.filter(resolution=Resolution.HOUR, bucket__gte=start, bucket__lt=cut)
                     .order_by("bucket").values(*FLEET_FIELDS))
    minutes = list(FleetRollup.objects.filter(resolution=Resolution.MINUTE, bucket__gte=cut, bucket__lte=now)
                   .order_by("bucket").values(*FLEET_FIELDS))
    return hours + minutes


def gpu_util_range(*, time_range: TimeRange, now: datetime | None = None) -> dict[int, float]:
    """{gpu id: mean utilization (%) over the range}, weighted by sample counts, from the same
    hourly + minute split as fleet_range. GPUs without samples in the range are absent."""
    now = now or timezone.now()
    start = now - time_range.span
    cut = _minutes_from(start=start, now=now, resolution=time_range.resolution, hourly_model=GpuRollup)
    weighted = F("util_avg") * F("samples")
    totals: dict[int, list[float]] = {}
    parts = [(Resolution.MINUTE, {"bucket__gte": cut, "bucket__lte": now})]
    if cut > start:
        parts.append((Resolution.HOUR, {"bucket__gte": start, "bucket__lt": cut}))
    for resolution, window in parts:
        for gpu_id, w, n in (GpuRollup.objects.filter(resolution=resolution, **window).values("gpu_id")
                             .annotate(w=Sum(weighted), n=Sum("samples")).order_by().values_list("gpu_id", "w", "n")):
            acc = totals.setdefault(gpu_id, [0.0, 0])
            acc[0] += w or 0.0
            acc[1] += n or 0
    return {gpu_id: w / n for gpu_id, (w, n) in totals.items() if n}


def gpu_minutes(*, gpu_ids: list[int], start: datetime, now: datetime | None = None,
                max_span: timedelta = timedelta(hours=24)) -> dict:
    """Minute rollups of some GPUs from `start` (at most `max_span` back), aligned on one time
    axis for a chart: {t: [epoch s], gpus: {gpu id: {utilization, memory_used_mb, power_w: [..]}}},
    None where a GPU has no row for a minute. Times are the minutes' middles."""
    now = now or timezone.now()
    rows = list(GpuRollup.objects.filter(resolution=Resolution.MINUTE, gpu_id__in=gpu_ids,
                                         bucket__gte=max(start, now - max_span) - timedelta(minutes=1))
                .order_by("bucket").values_list("gpu_id", "bucket", "util_avg", "memory_used_avg_mb", "power_avg_w"))
    times = sorted({b for _, b, *_ in rows})
    at = {b: i for i, b in enumerate(times)}
    out = {g: {"utilization": [None] * len(times), "memory_used_mb": [None] * len(times),
               "power_w": [None] * len(times)} for g in gpu_ids}
    for gpu_id, bucket, util, mem, power in rows:
        i = at[bucket]
        out[gpu_id]["utilization"][i] = round(util, 1)
        out[gpu_id]["memory_used_mb"][i] = round(mem)
        out[gpu_id]["power_w"][i] = round(power, 1)
    return {"t": [int(b.timestamp()) + 30 for b in times], "gpus": out}


# A GPU counts as idle only when minute rollups cover this share of the window: no samples is
# no evidence (a silent agent is the reaper's business), and the newest minute is not rolled yet.
IDLE_COVERAGE = 0.8


def idle_job_ids(*, now: datetime | None = None) -> set[int]:
    """Running jobs that held all their GPUs for the last GPU_IDLE_MINUTES and whose every GPU
    stayed under GPU_IDLE_UTIL_PCT throughout (peak of the minute rollups). CPU-only jobs never."""
    now = now or timezone.now()
    start = now - timedelta(minutes=settings.GPU_IDLE_MINUTES)
    gpus_of: dict[int, set[int]] = defaultdict(set)
    young = set()
    for job_id, gpu_id, started in Allocation.objects.filter(
            released_at__isnull=True, job__state=JobState.RUNNING).values_list("job_id", "gpu_id", "started_at"):
        gpus_of[job_id].add(gpu_id)
        if started > start:
            young.add(job_id)
    candidates = {job_id: gpus for job_id, gpus in gpus_of.items() if job_id not in young}
    if not candidates:
        return set()
    need = max(1, int(settings.GPU_IDLE_MINUTES * IDLE_COVERAGE))
    idle_gpus = {gpu_id for gpu_id, peak, n in GpuRollup.objects.filter(
        resolution=Resolution.MINUTE, bucket__gte=start, bucket__lt=now,
        gpu_id__in=set().union(*candidates.values())).values("gpu_id").annotate(
        peak=Max("util_max"), n=Count("id")).values_list("gpu_id", "peak", "n").order_by()
        if peak < settings.GPU_IDLE_UTIL_PCT and n >= need}
    return {job_id for job_id, gpus in candidates.items() if gpus <= idle_gpus}
