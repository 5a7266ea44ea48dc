"""Writes for GPU metrics: sample ingest, health rules, rollups, pruning."""
import json
import logging
import threading
import time
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Avg, Count, F, Max, Q, Sum
from django.db.models.functions import TruncHour, TruncMinute
from django.utils import timezone

from portal.core.context import Actor
from portal.core.errors import Conflict
from portal.core.numbers import parse_ints
from portal.core.queue import request_schedule_pass
from portal.core.services import audit_record
from portal.jobs.models import ACTIVE, Allocation, Job, JobEvent, JobState
from portal.jobs.node_effects import gpu_unhealthy_handle
from portal.jobs.notifications import notify_on_commit
from portal.jobs.services import job_cancel
from portal.nodes.models import GPU, GPUHealth, NodeState

from .models import FleetRollup, GpuRollup, GpuSample, Resolution
from .selectors import idle_job_ids

log = logging.getLogger(__name__)

COLUMNS = ("gpu_id", "ts", "utilization", "memory_used_mb", "memory_total_mb", "temperature_c", "power_w",
           "ecc_errors", "xid_errors")
TEMPERATURE_REASON = "temperature"


def _ts(value, default: datetime) -> datetime:
    """Agents send epoch seconds or ISO 8601; anything else (or a clock far off) gets the portal's time."""
    try:
        if isinstance(value, (int, float)):
            ts = datetime.fromtimestamp(float(value), tz=dt_timezone.utc)
        elif isinstance(value, str):
            ts = datetime.fromisoformat(value)
            ts = ts if ts.tzinfo else ts.replace(tzinfo=dt_timezone.utc)
        else:
            return default
    except (ValueError, OverflowError, OSError):
        return default
    # A skewed agent clock must not write rows into last year's or next week's buckets.
    return ts if abs((ts - default).total_seconds()) < 600 else default


def _num(value, default=0.0) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return out if out == out and abs(out) < 1e12 else default  # NaN and absurd values: default


def _int32(value) -> int:
    """Within the integer columns' range: the agent API bounds each field, and this keeps one
    row that slipped past (a direct caller) from failing a shared batch of other nodes' rows."""
    return int(min(2**31 - 1, max(-(2**31), _num(value))))


def _list(value) -> list:
    """A list field as an agent may send it: a list, one bare value, or nothing."""
    if value is None or value == "":
        return []
    return value if isinstance(value, list) else [value]


def sample_rows(gpu_ids: dict[str, int], samples: list[dict], now: datetime) -> list[tuple]:
    rows = []
    for s in samples:
        gpu_id = gpu_ids.get(str(s.get("gpu_uuid")))
        if gpu_id is None:
            continue  # a GPU not (or no longer) registered on this node
        xids = parse_ints(_list(s.get("xid_errors")), limit=32)
        rows.append((gpu_id, _ts(s.get("ts"), now), min(100.0, max(0.0, _num(s.get("utilization")))),
                     _int32(s.get("memory_used_mb")), _int32(s.get("memory_total_mb")),
                     _num(s.get("temperature_c")), _num(s.get("power_w")), _int32(s.get("ecc_errors")), xids))
    return rows


def samples_write(rows: list[tuple]) -> int:
    """One batch of sample rows: COPY on PostgreSQL (an order of magnitude faster than INSERT).
    The commit does not wait for the WAL flush (synchronous_commit off, this transaction only):
    a crash may lose the last few hundred milliseconds of samples, never corrupt anything, and
    samples are informational (billing meters allocations). It roughly triples small batches.
    """
    if not rows:
        return 0
    if connection.vendor == "postgresql":
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")
            sql = f"COPY {GpuSample._meta.db_table} ({', '.join(COLUMNS)}) FROM STDIN"
            with cursor.cursor.copy(sql) as copy:
                for row in rows:
                    copy.write_row(row[:-1] + (json.dumps(row[-1]),))
    else:
        GpuSample.objects.bulk_create([GpuSample(**dict(zip(COLUMNS, row))) for row in rows], batch_size=500)
    return len(rows)


class _Buffer:
    """Samples waiting in this process for one COPY: flushed at METRICS_INGEST_BATCH rows or when
    the oldest has waited METRICS_INGEST_FLUSH_S, by whichever heartbeat crosses the line.
    A process that dies loses what it buffered (seconds of informational samples)."""

    def __init__(self):
        self.rows: list[tuple] = []
        self.since = 0.0
        self.lock = threading.Lock()

    def add(self, rows: list[tuple]) -> list[tuple]:
        with self.lock:
            if not self.rows:
                self.since = time.monotonic()
            self.rows.extend(rows)
            if (len(self.rows) >= settings.METRICS_INGEST_BATCH
                    or time.monotonic() - self.since >= settings.METRICS_INGEST_FLUSH_S):
                out, self.rows = self.rows, []
                return out
        return []

    def drain(self) -> list[tuple]:
        with self.lock:
            out, self.rows = self.rows, []
        return out


BUFFER = _Buffer()


def samples_flush() -> int:
    """Write whatever this process has buffered (at exit, and from tests and benchmarks)."""
    return samples_write(BUFFER.drain())


_GPU_MAPS: dict[int, tuple[float, dict]] = {}
GPU_MAP_TTL_S = 10.0


def _node_gpus(node_id: int, uuids=()) -> dict[str, tuple]:
    """{uuid: (pk, health, reason)} of a node's GPUs, kept 10 s in this process: a heartbeat
    then costs no query. Health this process changes is written through; a change made
    elsewhere (an operator) is seen within the TTL; a UUID the map lacks (a re-registered
    node) reloads it at once."""

    hit = _GPU_MAPS.get(node_id)
    if hit is not None and hit[0] > time.monotonic() and all(u in hit[1] for u in uuids):
        return hit[1]
    gpus = {uuid: (pk, health, reason) for pk, uuid, health, reason in
            GPU.objects.filter(node_id=node_id).values_list("pk", "uuid", "health", "health_reason")}
    _GPU_MAPS[node_id] = (time.monotonic() + GPU_MAP_TTL_S, gpus)
    return gpus


def samples_own(*, node, samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """This node's GPUs' samples, and [{position, gpu_uuid, errors}] for the others: a node token
    reports for its own GPUs only (the others' live tiles, history and health are not its to write)."""
    gpus = _node_gpus(node.pk, [str(s.get("gpu_uuid")) for s in samples])
    own, refused = [], []
    for position, s in enumerate(samples):
        if str(s.get("gpu_uuid")) in gpus:
            own.append(s)
        else:
            refused.append({"position": position, "gpu_uuid": s.get("gpu_uuid"),
                            "errors": {"gpu_uuid": [f"GPU {s.get('gpu_uuid')} is not a GPU of node {node.name}."]}})
    return own, refused


def samples_ingest(*, node, samples: list[dict], now: datetime | None = None) -> dict:
    """Buffer a heartbeat's samples and apply the health rules to them (called by agent_heartbeat)."""
    now = now or timezone.now()
    gpus = _node_gpus(node.pk, [str(s.get("gpu_uuid")) for s in samples])
    rows = sample_rows({u: v[0] for u, v in gpus.items()}, samples, now)
    flushed = samples_write(BUFFER.add(rows))
    changed = gpu_health_apply(node=node, samples=samples, gpus=gpus)
    return {"buffered": len(rows), "flushed": flushed, "health_changed": changed}


def health_verdict(sample: dict) -> str | None:
    """Why a sample makes its GPU unhealthy, or None when it is fine (docs/design.md section 6)."""
    xids = parse_ints(_list(sample.get("xid_errors")), limit=1024)
    xids = [x for x in xids if x not in settings.GPU_HEALTH_IGNORED_XIDS]
    if xids:
        return f"Xid error {', '.join(str(x) for x in xids[:5])} reported by the driver"
    ecc = int(_num(sample.get("ecc_errors")))
    if ecc > settings.GPU_HEALTH_MAX_ECC_ERRORS:
        return f"ECC errors: {ecc} (limit {settings.GPU_HEALTH_MAX_ECC_ERRORS})"
    temp = _num(sample.get("temperature_c"))
    if temp > settings.GPU_HEALTH_MAX_TEMP_C:
        return f"{TEMPERATURE_REASON} {temp:.0f} °C above the limit of {settings.GPU_HEALTH_MAX_TEMP_C:.0f} °C"
    return None


def gpu_health_apply(*, node, samples: list[dict], gpus: dict[str, tuple]) -> int:
    """Mark GPUs unhealthy by the rules; a GPU unhealthy only for heat comes back once it has
    cooled 5 °C under the limit. Xid and ECC verdicts stay until an operator clears them (an
    Xid usually means the GPU needs a reset). Only changes are written; a change asks for a pass,
    and a GPU turning unhealthy has its jobs requeued or warned (jobs.node_effects.gpu_unhealthy_handle)."""
    changed = 0
    for s in samples:
        uuid = str(s.get("gpu_uuid"))
        if uuid not in gpus:
            continue
        pk, health, reason = gpus[uuid]
        verdict = health_verdict(s)
        if verdict and health == GPUHealth.HEALTHY:
            new = (GPUHealth.UNHEALTHY, verdict[:200])
        elif (not verdict and health == GPUHealth.UNHEALTHY and reason.startswith(TEMPERATURE_REASON)
              and _num(s.get("temperature_c")) <= settings.GPU_HEALTH_MAX_TEMP_C - 5):
            new = (GPUHealth.HEALTHY, "")
        else:
            continue
        with transaction.atomic():
            # The reason too: a GPU that turned unhealthy for another cause meanwhile (a failed scrub)
            # must not be healed by cooling down.
            if GPU.objects.filter(pk=pk, health=health, health_reason=reason).update(health=new[0],
                                                                                     health_reason=new[1]):
                gpu = GPU.objects.select_related("node").get(pk=pk)
                audit_record(actor=Actor(user=None, label=f"node:{node.name}"), action=f"gpu.{new[0]}", obj=gpu,
                             reason=new[1] or reason)
                if new[0] == GPUHealth.UNHEALTHY:
                    gpu_unhealthy_handle(gpu=gpu, reason=new[1])  # requeue or warn its jobs, maybe drain
                changed += 1
                gpus[uuid] = (pk, new[0], new[1])
    if changed:
        request_schedule_pass()
    return changed


def _floor(dt: datetime, seconds: int) -> datetime:
    epoch = int(dt.timestamp()) // seconds * seconds
    return datetime.fromtimestamp(epoch, tz=dt_timezone.utc)


def rollup_minutes(*, now: datetime | None = None, lookback_minutes: int = 5) -> int:
    """Roll the last complete minutes of raw samples into GPU and fleet minute rollups.
    Re-rolls a few minutes back on every run, so late samples and missed runs are caught; the
    rows are upserted, so re-running is harmless.
    """
    now = now or timezone.now()
    end = _floor(now, 60)
    start = end - timedelta(minutes=lookback_minutes)
    rows = (GpuSample.objects.filter(ts__gte=start, ts__lt=end)
            .annotate(b=TruncMinute("ts", tzinfo=dt_timezone.utc)).values("gpu_id", "b")
            .annotate(n=Count("id"), ua=Avg("utilization"), um=Max("utilization"), ma=Avg("memory_used_mb"),
                      tm=Max("temperature_c"), pa=Avg("power_w")).order_by())
    rollups = [GpuRollup(gpu_id=r["gpu_id"], resolution=Resolution.MINUTE, bucket=r["b"], samples=r["n"],
                         util_avg=r["ua"], util_max=r["um"], memory_used_avg_mb=r["ma"], temperature_max_c=r["tm"],
                         power_avg_w=r["pa"]) for r in rows]
    _upsert_gpu(rollups)
    buckets = [start + timedelta(minutes=i) for i in range(lookback_minutes)]
    _fleet(buckets, Resolution.MINUTE, now)
    return len(rollups)


def rollup_hours(*, now: datetime | None = None, lookback_hours: int = 2) -> int:
    """Hourly rollups from minute rollups (means weighted by sample counts), current hour included."""
    now = now or timezone.now()
    end = _floor(now, 3600) + timedelta(hours=1)
    start = end - timedelta(hours=lookback_hours)
    rows = (GpuRollup.objects.filter(resolution=Resolution.MINUTE, bucket__gte=start, bucket__lt=end)
            .annotate(b=TruncHour("bucket", tzinfo=dt_timezone.utc)).values("gpu_id", "b")
            .annotate(n=Sum("samples"), uw=Sum(_weighted("util_avg")), um=Max("util_max"),
                      mw=Sum(_weighted("memory_used_avg_mb")), tm=Max("temperature_max_c"),
                      pw=Sum(_weighted("power_avg_w"))).order_by())
    rollups = [GpuRollup(gpu_id=r["gpu_id"], resolution=Resolution.HOUR, bucket=r["b"], samples=r["n"],
                         util_avg=r["uw"] / r["n"], util_max=r["um"], memory_used_avg_mb=r["mw"] / r["n"],
                         temperature_max_c=r["tm"], power_avg_w=r["pw"] / r["n"]) for r in rows if r["n"]]
    _upsert_gpu(rollups)
    _fleet([start + timedelta(hours=i) for i in range(lookback_hours)], Resolution.HOUR, now)
    return len(rollups)


def _weighted(field: str):
    return F(field) * F("samples")


def _upsert_gpu(rollups: list[GpuRollup]) -> None:
    if rollups:
        GpuRollup.objects.bulk_create(
            rollups, update_conflicts=True, unique_fields=["gpu", "resolution", "bucket"],
            update_fields=["samples", "util_avg", "util_max", "memory_used_avg_mb", "temperature_max_c",
                           "power_avg_w"], batch_size=2000)


def _fleet(buckets: list[datetime], resolution: int, now: datetime) -> None:
    """Fleet figures per bucket: allocated GPUs from Allocation overlap, used GPUs from rollups."""

    if not buckets:
        return
    span = timedelta(seconds=resolution)
    first, last = buckets[0], buckets[-1] + span
    gpus = GPU.objects.exclude(node__state=NodeState.DOWN).count()
    allocs = list(Allocation.objects.filter(started_at__lt=last).filter(
        Q(released_at__isnull=True) | Q(released_at__gt=first)).values_list("started_at", "released_at", "fraction"))
    used = dict(GpuRollup.objects.filter(resolution=resolution, bucket__gte=first, bucket__lt=last)
                .values("bucket").annotate(u=Sum("util_avg")).values_list("bucket", "u"))
    starts = list(Job.objects.filter(started_at__gte=first, started_at__lt=last).values_list("started_at",
                                                                                          "submitted_at"))
    queued = Job.objects.filter(state=JobState.QUEUED, is_array_parent=False).count()
    current = _floor(now, resolution)
    existing = dict(FleetRollup.objects.filter(resolution=resolution, bucket__in=buckets)
                    .values_list("bucket", "queued_jobs"))
    rows = []
    for b in buckets:
        end = min(b + span, now)
        held = sum(max(0.0, (min(r or end, end) - max(s, b)).total_seconds()) * float(f) for s, r, f in allocs)
        waits = [(s - sub).total_seconds() for s, sub in starts if b <= s < b + span]
        # Queue depth is a reading, not a sum: take it for the current bucket, keep earlier readings.
        depth = queued if b >= current - span else existing.get(b, queued)
        rows.append(FleetRollup(resolution=resolution, bucket=b, gpus=gpus,
                                allocated_gpus=held / resolution, used_gpus=(used.get(b) or 0.0) / 100,
                                queued_jobs=depth, started_jobs=len(waits),
                                wait_avg_s=sum(waits) / len(waits) if waits else None))
    FleetRollup.objects.bulk_create(rows, update_conflicts=True, unique_fields=["resolution", "bucket"],
                                    update_fields=["gpus", "allocated_gpus", "used_gpus", "queued_jobs",
                                                   "started_jobs", "wait_avg_s"])


def metrics_prune(*, now: datetime | None = None) -> dict:
    """Drop raw samples past METRICS_RAW_DAYS and minute rollups past METRICS_MINUTE_DAYS."""
    now = now or timezone.now()
    raw, _ = GpuSample.objects.filter(ts__lt=now - timedelta(days=settings.METRICS_RAW_DAYS)).delete()
    minute_cut = now - timedelta(days=settings.METRICS_MINUTE_DAYS)
    minutes, _ = GpuRollup.objects.filter(resolution=Resolution.MINUTE, bucket__lt=minute_cut).delete()
    fleet, _ = FleetRollup.objects.filter(resolution=Resolution.MINUTE, bucket__lt=minute_cut).delete()
    return {"samples": raw, "minute_rollups": minutes + fleet}


def jobs_flag_idle(*, now=None) -> dict:
    """Flag running jobs whose GPUs all sat idle (the `metrics.flag_idle_jobs` beat task, every minute).
    1. Find them from the minute rollups (selectors.idle_job_ids).
    2. Flag the new ones: idle_since is set by a conditional UPDATE, so a job is flagged once
       however often this runs; active jobs whose GPUs work again are unflagged.
    3. Each newly flagged job gets a timeline event, and in a project whose quota has
       idle_auto_cancel it is cancelled by the system with the reason.
    """
    now = now or timezone.now()
    idle = idle_job_ids(now=now)
    unflagged = Job.objects.filter(idle_since__isnull=False, state__in=ACTIVE).exclude(pk__in=idle).update(
        idle_since=None)
    why = f"its GPUs stayed under {settings.GPU_IDLE_UTIL_PCT:g}% utilization for {settings.GPU_IDLE_MINUTES} minutes"
    flagged = cancelled = 0
    for job in Job.objects.filter(pk__in=idle, idle_since__isnull=True).select_related("project__quota"):
        with transaction.atomic():
            if not Job.objects.filter(pk=job.pk, idle_since__isnull=True, state=JobState.RUNNING).update(
                    idle_since=now):
                continue  # ended or flagged meanwhile
            JobEvent.objects.create(job=job, attempt=job.attempt, state=job.state, message=f"Flagged idle: {why}.")
            notify_on_commit(job.pk, job.attempt, "idle")
            flagged += 1
        if job.project.quota.idle_auto_cancel:
            try:
                job_cancel(actor=Actor(user=None, label="idle-detector"), job=job,
                           reason=f"Cancelled as idle: {why}, and project {job.project.slug} cancels idle jobs.")
                cancelled += 1
            except Conflict:
                pass  # it ended on its own meanwhile
    return {"idle": len(idle), "flagged": flagged, "unflagged": unflagged, "cancelled": cancelled}
