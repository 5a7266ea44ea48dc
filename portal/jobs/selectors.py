"""Reads for jobs: usage figures the scheduler and submit checks need, list filters."""
import codecs
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from datetime import datetime, timezone as dt_timezone
from decimal import Decimal

from django.core.cache import cache
from django.db import connection
from django.db.models import Count, DateTimeField, F, Sum
from django.db.models.functions import Length
from django.utils import timezone

from agents.sandbox.volumes import checkpoint_relpath, volume_relpath
from portal.core.prepared import AnyOf, Prepared, any_array
from portal.tenancy.models import allowed_project_ids, staff_bypass

from .models import (ACTIVE, HOLDING, TERMINAL, Allocation, Job, JobLogChunk, ProjectFairshare,
                     ProjectMonthUsage)


def month_start(now: datetime | None = None) -> datetime:
    now = now or timezone.now()
    return now.astimezone(dt_timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_month(start: datetime) -> datetime:
    return start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)


def decay(value: float, seconds: float, half_life_s: float) -> float:
    """`value` after `seconds` of exponential decay with this half-life."""
    return value * 0.5 ** (seconds / half_life_s)


def untallied_allocations(project_ids):
    """Allocations not in the usage totals yet (portal/jobs/usage.py): the open ones and those
    released since the last fold, a few per GPU whatever the history."""
    return Allocation.objects.filter(job__project_id__in=list(project_ids), tallied=False).values_list(
        "job__project_id", "started_at", "released_at", "fraction")


def gpu_hours_used_this_month(project_ids, now: datetime | None = None) -> dict[int, float]:
    """GPU-hours each project's allocations covered since the start of the month (open ones up to now).

    The one figure of GPU-hours used: the scheduler's budget stop, submit's check, the budget
    alerts and the budgets page all read it (gpu_hours_used for a past month). Two indexed reads
    whatever the month's history: the month's running total, and the allocations not in it yet."""
    ids = list(project_ids)
    now = now or timezone.now()
    if connection.vendor == "postgresql":
        return _month_hours_sql(ids, now)
    return _month_hours(ids, now, list(untallied_allocations(ids)))


def _month_hours_sql(ids: list[int], now: datetime) -> dict[int, float]:
    """_month_hours for this month in one statement that sums in PostgreSQL: a submit checks its
    project's budget with it, and under a stream of short jobs the untallied allocations are a few
    hundred rows whose transfer and conversion cost more than the sum."""
    start = month_start(now)
    ids_in = "= " + any_array("bigint")  # one generic plan, whatever the list (a submit's is one project)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT project_id, sum(s) / 3600 FROM ("
            f"SELECT project_id, gpu_s AS s FROM {ProjectMonthUsage._meta.db_table} "
            f"WHERE project_id {ids_in} AND month = %s "
            f"UNION ALL SELECT j.project_id, greatest(0, extract(epoch FROM "
            f"least(coalesce(a.released_at, %s), %s) - greatest(a.started_at, %s)))::float8 * a.fraction::float8 "
            f"FROM {Allocation._meta.db_table} a JOIN {Job._meta.db_table} j ON j.id = a.job_id "
            f"WHERE j.project_id {ids_in} AND NOT a.tallied) usage GROUP BY project_id",
            [ids, start.date(), now, now, start, ids])
        return {project_id: hours for project_id, hours in cursor.fetchall()}


def gpu_hours_used(project_ids, *, month: datetime, now: datetime | None = None) -> dict[int, float]:
    """gpu_hours_used_this_month for the UTC month that starts at `month`: allocations counted up
    to the month's end (or now, whichever is first)."""
    now = now or timezone.now()
    ids = list(project_ids)
    return _month_hours(ids, min(now, next_month(month)), list(untallied_allocations(ids)), start=month)


def decayed_usage(project_ids, *, half_life_s: float, now: datetime | None = None) -> dict[int, float]:
    """GPU-seconds per project, each allocation weighted by 0.5 ** (age / half_life), age measured
    to the allocation's end (now for open ones): the running total decayed to now, plus the
    allocations not in it yet. A total kept under another half-life (the setting changed; the
    next fold rebuilds it) is replaced by its project's allocations."""
    ids = list(project_ids)
    return _decayed(ids, half_life_s, now or timezone.now(), list(untallied_allocations(ids)))


def usage_for_pass(project_ids, *, half_life_s: float, now: datetime) -> tuple[dict[int, float], dict[int, float]]:
    """(gpu_hours_used_this_month, decayed_usage) as a pass needs both. On PostgreSQL in one
    statement compiled once per process that sums where the rows are: the untallied allocations
    (every open one, and those released since the last fold) were hundreds of rows whose transfer
    and conversion cost a pass more than the sums. Elsewhere, or while a fair-share total is kept
    under another half-life (the next fold rebuilds it), one read of those rows serves both."""
    ids = list(project_ids)
    if connection.vendor == "postgresql":
        hours, usage, stale = {}, {}, False
        for project_id, used_s, decayed_s, other_half_life in _PASS_USAGE.rows(
                ids=ids, month=month_start(now).date(), now=now, start=month_start(now), half_life=float(half_life_s)):
            stale = stale or other_half_life
            if used_s is not None:
                hours[project_id] = used_s / 3600
            if decayed_s is not None:
                usage[project_id] = decayed_s
        if not stale:
            return hours, usage
    rows = list(untallied_allocations(ids))
    return _month_hours(ids, now, rows), _decayed(ids, half_life_s, now, rows)


def _pass_usage_sql(ids, month, now, start, half_life) -> tuple[str, list]:
    """usage_for_pass's statement: per project, this month's GPU-seconds (the month's total and
    the untallied allocations' overlap with the month, open ones up to now), the decayed
    GPU-seconds (the fair-share total decayed to now and each untallied allocation decayed from
    its end), and whether a fair-share total was kept under another half-life. A sum is NULL
    where the project has no row of its kind, as _month_hours and _decayed leave it out. The ids
    go through `any_array` (portal/core/prepared.py): one generic plan, not one a pass."""
    allocation, job, ids_in = Allocation._meta.db_table, Job._meta.db_table, "= " + any_array("bigint")
    return (
        f"SELECT project_id, sum(used), sum(decayed), bool_or(other) FROM ("
        f"SELECT project_id, gpu_s AS used, NULL::float8 AS decayed, false AS other "
        f"FROM {ProjectMonthUsage._meta.db_table} WHERE project_id {ids_in} AND month = %s "
        f"UNION ALL SELECT project_id, NULL, decayed_gpu_s * power(0.5, extract(epoch FROM %s - as_of)::float8 / %s), "
        f"half_life_s <> %s FROM {ProjectFairshare._meta.db_table} WHERE project_id {ids_in} "
        f"UNION ALL SELECT j.project_id, greatest(0, extract(epoch FROM "
        f"least(coalesce(a.released_at, %s), %s) - greatest(a.started_at, %s))::float8) * a.fraction::float8, "
        f"greatest(0, extract(epoch FROM coalesce(a.released_at, %s) - a.started_at)::float8) * a.fraction::float8 "
        f"* power(0.5, extract(epoch FROM %s - coalesce(a.released_at, %s))::float8 / %s), false "
        f"FROM {allocation} a JOIN {job} j ON j.id = a.job_id WHERE j.project_id {ids_in} AND NOT a.tallied"
        f") usage GROUP BY project_id",
        [ids, month, now, half_life, half_life, ids, now, now, start, now, now, now, half_life, ids])


# Placeholders for its values (portal/core/prepared.py finds them among the parameters by identity).
_PASS_USAGE = Prepared(_pass_usage_sql, ids=[], month=datetime(1970, 1, 1).date(),
                       now=datetime(1970, 1, 1, tzinfo=dt_timezone.utc),
                       start=datetime(1970, 1, 2, tzinfo=dt_timezone.utc), half_life=float("inf"))


def _month_hours(ids: list[int], now: datetime, rows: list, start: datetime | None = None) -> dict[int, float]:
    """Hours in the month from `start` (that of `now` by default) up to `now`."""
    start = start or month_start(now)
    used: dict[int, float] = defaultdict(float)
    for project_id, gpu_s in ProjectMonthUsage.objects.filter(project_id__in=ids, month=start.date()).values_list(
            "project_id", "gpu_s"):
        used[project_id] += gpu_s / 3600
    for project_id, started, released, fraction in rows:
        seconds = (min(released or now, now) - max(started, start)).total_seconds()
        used[project_id] += max(0.0, seconds) * float(fraction) / 3600
    return dict(used)


def _decayed(ids: list[int], half_life_s: float, now: datetime, rows: list) -> dict[int, float]:
    usage: dict[int, float] = defaultdict(float)
    stale = []
    for project_id, half_life, value, as_of in ProjectFairshare.objects.filter(project_id__in=ids).values_list(
            "project_id", "half_life_s", "decayed_gpu_s", "as_of"):
        if half_life != half_life_s:
            stale.append(project_id)
        else:
            usage[project_id] += decay(value, (now - as_of).total_seconds(), half_life_s)
    if stale:
        rows = rows + list(Allocation.objects.filter(job__project_id__in=stale, tallied=True).values_list(
            "job__project_id", "started_at", "released_at", "fraction"))
    for project_id, started, released, fraction in rows:
        end = released or now
        seconds = max(0.0, (end - started).total_seconds()) * float(fraction)
        usage[project_id] += decay(seconds, (now - end).total_seconds(), half_life_s)
    return dict(usage)


def volume_mounts(job) -> dict:
    """The job's volumes and checkpoint folder as paths below the operator's volumes root (the
    agent joins them to its --volumes-root): the same folder for every attempt, on any node. The
    checkpoints go to the first writable volume, else to the project's own checkpoint folder."""
    return _mounts(job.project.organization.slug, job.project.slug, job.pk, job.volumes)


def _mounts(org: str, project: str, job_id: int, volumes: list | None) -> dict:
    mounts = [{"name": m["name"], "read_only": bool(m.get("read_only")),
               "path": volume_relpath(org, project, m["name"])} for m in volumes or []]
    writable = next((m["name"] for m in mounts if not m["read_only"]), None)
    return {"volumes": mounts, "checkpoint": {"volume": writable,
                                              "path": checkpoint_relpath(org, project, job_id, writable)}}


# job_launch_parts' two reads, compiled once (portal/core/prepared.py): a pass publishes launches
# every time it starts a job, and building these queries cost more than running them.
# A pass may launch thousands: rows, not models (building a model each, its signals and
# descriptors, was most of the cost), each job's columns as attributes with what it needs of its
# project; but its times and avoided nodes, which a launch does not read. No model per allocation
# either.
_LAUNCH_JOBS = Prepared(lambda ids: Job.objects.filter(AnyOf(F("pk"), ids), state__in=HOLDING).values(
    *(f.attname for f in Job._meta.concrete_fields if not isinstance(f, DateTimeField) and f.name != "avoid_nodes"),
    node_name=F("node__name"), project_slug=F("project__slug"), org_slug=F("project__organization__slug"),
    network_allowed=F("project__quota__network_allowed")), ids=[])
_LAUNCH_ALLOCATIONS = Prepared(lambda ids: Allocation.objects.filter(
    AnyOf(F("job_id"), ids), released_at__isnull=True).order_by("gpu__node__name", "gpu__index").values_list(
    "job_id", "gpu__node__name", "gpu__index", "gpu__uuid", "fraction", "shared"), ids=[])


def job_launch_parts(pairs: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """The jobs' part of the launch specs for (node name, job id) pairs, in two queries whatever
    their number; pairs whose job no longer holds GPUs on that node are left out. Multi-node gangs
    get the rendezvous variables torchrun and NCCL use. `datasets` holds the job's dataset
    references as submitted and `sessions` is empty: portal.launch, above storage and interactive,
    puts in the files to fetch and the published ports (docs/design.md section 2)."""
    ids = list({job_id for _, job_id in pairs})
    jobs = {row["id"]: SimpleNamespace(pk=row["id"], **row) for row in _LAUNCH_JOBS.rows(ids=ids)}
    allocs: dict[int, list] = defaultdict(list)
    for job_id, *held in _LAUNCH_ALLOCATIONS.rows(ids=list(jobs)) if jobs else ():
        allocs[job_id].append(held)  # node, index, uuid, fraction, shared
    out = {}
    for node_name, job_id in pairs:
        job = jobs.get(job_id)
        if job is None:
            continue
        held = allocs.get(job_id, [])
        nodes = list(dict.fromkeys(a[0] for a in held)) or [job.node_name or node_name]
        if node_name not in nodes:
            continue
        mine = [a for a in held if a[0] == node_name]
        rendezvous = None
        if len(nodes) > 1:
            # The master is the first node; the port is derived from the job id so gangs do not collide.
            rendezvous = {"MASTER_ADDR": nodes[0], "MASTER_PORT": str(29500 + job.pk % 1000),
                          "WORLD_SIZE": str(len(held)), "NODE_RANK": str(nodes.index(node_name)),
                          "LOCAL_WORLD_SIZE": str(len(mine))}
        fraction = float(mine[0][3]) if mine and mine[0][4] else None
        out[(node_name, job_id)] = {
            "job_id": str(job.pk), "attempt": job.attempt, "image": job.image, "command": job.command,
            "env": job.env, "gpu_indexes": [a[1] for a in mine], "gpu_uuids": [a[2] for a in mine],
            "cpus": float(job.cpus), "memory_mb": job.memory_mb, "time_limit_s": job.time_limit_s,
            "network": bool(job.network and job.network_allowed), "sandbox": job.sandbox,
            "array_index": job.array_index, "gpu_fraction": fraction,
            "gpu_memory_mb": job.gpu_memory_mb or None, "rendezvous": rendezvous,
            "project_id": job.project_id,  # the docker sandbox runs each project under a uid of its own
            "outputs": True,  # /outputs, uploaded as the attempt's artifacts when it ends (docs/storage.md)
            "checkpoint_signal": job.checkpoint_signal or None, "checkpoint_grace_s": job.checkpoint_grace_s,
            "checkpoint_interval_s": job.checkpoint_interval_s,
            **_mounts(job.org_slug, job.project_slug, job.pk, job.volumes),
            "datasets": job.datasets or [],  # references here; the files to fetch in portal.launch
            "sessions": [],  # published ports: portal.launch
        }
    return out


# Reads for the pages (jobs list, detail, dashboard).


def gpus_in_use(project_ids) -> dict[int, Decimal]:
    """GPUs each project holds now: the sum of its open allocations' fractions."""
    rows = (Allocation.objects.filter(job__project_id__in=list(project_ids), released_at__isnull=True)
            .values("job__project_id").annotate(n=Sum("fraction")).values_list("job__project_id", "n"))
    return {project_id: n or Decimal(0) for project_id, n in rows}


def jobs_for_list(*, user, project: str = "", state: str = "", submitted_from=None, submitted_to=None,
                  mine: bool = False):
    """Top-level jobs (array tasks are folded into their parent) a user may see, newest first.

    `state` is a state name, "active" or "finished"; dates are inclusive days.
    The order is stable: equal submit times fall back to the id.
    """
    qs = Job.objects.for_user(user, "view").filter(array_parent__isnull=True)
    if project:
        qs = qs.filter(project__slug=project)
    if state == "active":
        qs = qs.filter(state__in=ACTIVE)
    elif state == "finished":
        qs = qs.filter(state__in=TERMINAL)
    elif state:
        qs = qs.filter(state=state)
    if submitted_from:
        qs = qs.filter(submitted_at__date__gte=submitted_from)
    if submitted_to:
        qs = qs.filter(submitted_at__date__lte=submitted_to)
    if mine:
        qs = qs.filter(user=user)
    return qs.select_related("project", "user", "node").order_by("-submitted_at", "-id")


def task_histograms(parent_ids) -> dict[int, dict[str, int]]:
    """Array parents: how many tasks are in each state, in one query."""
    parent_ids = list(parent_ids)
    if not parent_ids:
        return {}
    out: dict[int, dict[str, int]] = defaultdict(dict)
    for parent_id, state, n in (Job.objects.filter(array_parent_id__in=parent_ids)
                                .values_list("array_parent_id", "state").annotate(n=Count("id"))
                                .order_by()):
        out[parent_id][state] = n
    return dict(out)


# One read of a job's log returns at most this many bytes: a page, not the whole log.
LOG_PAGE_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True)
class LogPage:
    """One range of an attempt's log. ``offset`` and ``next_offset`` count stored bytes."""

    data: str  # the bytes decoded as UTF-8; invalid bytes and NUL read as U+FFFD
    offset: int
    next_offset: int  # where the next read starts; equals ``size`` once everything stored was read
    size: int  # bytes stored for this attempt so far
    truncated: bool  # the log reached JOB_LOG_MAX_BYTES: it ends with the portal's notice


def utf8_whole_len(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data, final=False)
    return len(data) - len(decoder.getstate()[0])


def log_end(job, *, attempt: int) -> tuple[int, bool]:
    """(bytes stored for this attempt, whether the truncation notice closes it): from the last chunk."""
    last = (JobLogChunk.objects.filter(job=job, attempt=attempt).order_by("-offset")
            .values_list("offset", Length("data"), "marker").first())
    return (last[0] + last[1], last[2]) if last else (0, False)


def log_read(job, *, attempt: int, offset: int = 0, limit: int = LOG_PAGE_MAX_BYTES) -> LogPage:
    """Bytes ``[offset, offset + limit)`` of one attempt's log, decoded for people.

    A page never ends inside a UTF-8 character (unless ``limit`` is smaller than one), so the
    text of consecutive pages joins up exactly. Two indexed queries whatever the log's size:
    the chunk holding ``offset``, then those starting inside the range.
    """
    size, truncated = log_end(job, attempt=attempt)
    offset, limit = max(0, offset), max(1, limit)
    stop = min(offset + limit, size)
    if offset >= stop:
        return LogPage("", offset, offset, size, truncated)
    chunks = JobLogChunk.objects.filter(job=job, attempt=attempt)
    rows = list(chunks.filter(offset__lte=offset).order_by("-offset").values_list("offset", "data")[:1])
    rows += chunks.filter(offset__gt=offset, offset__lt=stop).order_by("offset").values_list("offset", "data")
    buf, pos = bytearray(), offset
    for start, data in rows:
        data = bytes(data)  # PostgreSQL hands back a memoryview
        if start + len(data) <= pos:
            continue
        pos = max(pos, start)  # a gap (bytes the portal never got) is skipped
        piece = data[pos - start:stop - start]
        buf += piece
        pos += len(piece)
    if pos < size:
        held = len(buf) - utf8_whole_len(bytes(buf))
        if held < len(buf):
            del buf[len(buf) - held:]
            pos -= held
    text = bytes(buf).decode("utf-8", errors="replace").replace("\x00", "\ufffd")
    return LogPage(text, offset, pos, size, truncated)


def job_gpu_samples(job) -> list[dict]:
    """The GPUs the job's latest attempt holds (or held), each with its latest sample if the
    cache still has one (`gpu-sample:<uuid>`, written by agent heartbeats for 5 minutes)."""
    allocs = list(Allocation.objects.filter(job=job, attempt=job.attempt).select_related("gpu__node")
                  .order_by("gpu__node__name", "gpu__index"))
    samples = cache.get_many([f"gpu-sample:{a.gpu.uuid}" for a in allocs]) if allocs else {}
    return [{"uuid": a.gpu.uuid, "index": a.gpu.index, "node": a.gpu.node.name, "model": a.gpu.model,
             "fraction": float(a.fraction), "open": a.released_at is None,
             "sample": samples.get(f"gpu-sample:{a.gpu.uuid}")} for a in allocs]


def env_reader_project_ids(user) -> set[int] | None:
    """Projects in which `user` may read the environment of everyone's jobs: where they are an
    owner or admin (None: every project, for staff). Anyone reads their own jobs' environment.
    An environment often holds secrets, so a viewer or another member does not see it."""
    if user is None or not user.is_authenticated:
        return set()
    if staff_bypass(user, "manage"):
        return None
    return set(allowed_project_ids(user, "manage").values_list("pk", flat=True))


def env_visible(job, user, readers: Callable[[], set[int] | None]) -> bool:
    """Whether `user` may see `job.env`; `readers` answers env_reader_project_ids(user), asked only
    for a job that is not the user's own (a submit's answer then costs no query)."""
    if user is not None and job.user_id == user.pk:
        return True
    reader_project_ids = readers()
    return reader_project_ids is None or job.project_id in reader_project_ids
