"""The Django side of a scheduling pass: build the snapshot from PostgreSQL, apply the plan.

`run_pass()` is what the `scheduler.schedule_pass` task runs. Steps:
1. Open a transaction and take a non-blocking advisory lock; a second pass returns at once.
2. End jobs whose dependencies failed (cancelled, with the reason).
3. Digest what the snapshot would read (`inputs_digest`); when nothing changed since the last
   full pass, within SCHEDULER_REPLAN_S and no reason note pending, its plan stands: only stale
   launches are re-sent (`_plan_stands`).
4. Build a `scheduler.core.Snapshot`: schedulable nodes and healthy GPUs, the jobs holding
   GPUs, queued jobs, quotas, decayed usage and this month's GPU-hours.
5. Run the pure core.
6. Apply in the same transaction: each start is a conditional queued->assigned transition
   plus its Allocation rows (the partial unique index refuses a double-booked whole GPU;
   shared fractions are summed under a row lock); each preemption ends the attempt and
   requeues the job with attempt+1; changed reasons and queue positions are written.
7. After commit, send `agent.launch` / `agent.stop` to the nodes' queues. A launch lost
   between commit and publish is re-sent by a later pass (jobs assigned too long ago).
"""
import hashlib
import logging
import math
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import IntegrityError, connection, transaction
from django.db.models import F, FloatField, Func, JSONField, Sum, Value
from django.db.models.functions import NullIf
from django.utils import timezone

from agents.protocol import LAUNCHES_SINCE, speaks
from portal.core import locks
from portal.core.crashpoints import crashpoint
from portal.core.passes import pass_begins
from portal.core.prepared import AnyOf, Prepared
from portal.jobs.models import (HOLDING, QOS_VALUE, TERMINAL, Allocation, Job, JobState, ProjectFairshare,
                                ProjectMonthUsage)
from portal.jobs.selectors import usage_for_pass
from portal.jobs.states import allocate_whole_gpus, assign_many, requeue_holding, transition
from portal.jobs.usage import usage_fold
from portal.launch import launch_specs
from portal.nodes.models import GPU, GPUHealth, GPUMode, Node, NodeState
from portal.storage.selectors import prefetch_entries
from portal.tenancy.models import Organization, Project, Quota
from scheduler import core
from scheduler.core.autoscale import wants_capacity

from .dispatch import send_launches, send_prefetch, send_stop

log = logging.getLogger(__name__)

def _epoch(dt) -> float:
    return dt.timestamp()


class Epoch(Func):
    """A timestamp as seconds since the epoch (a float), computed by the database: parsing
    thousands of datetimes in Python was most of a snapshot's cost."""

    output_field = FloatField()

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::float8", **extra)

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="((julianday(%(expressions)s) - 2440587.5) * 86400.0)",
                           **extra)


def config_from_settings() -> core.Config:
    return core.Config(
        policy=settings.SCHEDULER_POLICY,
        quotas=settings.SCHEDULER_QUOTAS,
        placement=settings.SCHEDULER_PLACEMENT,
        min_runtime_s=settings.SCHEDULER_MIN_RUNTIME_S,
        fairshare_half_life_s=settings.SCHEDULER_FAIRSHARE_HALF_LIFE_S,
        node_reserved_cpus=settings.NODE_RESERVED_CPUS,
        node_reserved_memory_mb=settings.NODE_RESERVED_MEMORY_MB,
        locality_wait_s=settings.SCHEDULER_LOCALITY_WAIT_S,
        prefetch_horizon_s=settings.SCHEDULER_PREFETCH_HORIZON_S,
    )


def _core_datasets(rows: list[dict]) -> tuple[core.Dataset, ...]:
    """Job.datasets (resolved at submit: name, version, digest, size) as the core's datasets."""
    return tuple(core.Dataset(d["digest"], int(d.get("size") or 0), f"{d['name']}@{d['version']}")
                 for d in rows) if rows else ()


def _avoid_ends(context, now_s: float) -> list[float]:
    """When waiting jobs may take a node they avoid again (Job.avoid_nodes): the plan changes then."""
    return [t for row in context["queued"].values() for t in (row.get("avoid_or_none") or {}).values()
            if isinstance(t, (int, float)) and t > now_s]


def _avoided(avoid: dict | None, now_s: float) -> frozenset[str]:
    """Job.avoid_nodes ({node: until, epoch seconds}) as the nodes still to avoid at ``now_s``."""
    return frozenset(n for n, until in avoid.items() if isinstance(until, (int, float)) and until > now_s) \
        if avoid else frozenset()


_FAILED_DEPENDENCIES = Prepared(lambda: Job.depends_on.through.objects.filter(
    from_job__state=JobState.QUEUED, to_job__state__in=TERMINAL - {JobState.SUCCEEDED}
).values_list("from_job_id", "to_job_id", "to_job__state"))


def _cancel_failed_dependents() -> int:
    ended = 0
    for job_id, dep_id, dep_state in _FAILED_DEPENDENCIES.rows():
        message = f"Dependency job {dep_id} ended {dep_state}; this job can never start."
        ended += transition(job_id, to=JobState.CANCELLED, from_states={JobState.QUEUED}, message=message,
                            reason_code="dependency_failed", reason_message=message)
    return ended


_EARLIER_ATTEMPTS = Prepared(lambda: Allocation.objects.filter(
    released_at__isnull=False, attempt__lt=F("job__attempt"),
    job__state__in=[JobState.QUEUED, *HOLDING]).values_list("job_id", "started_at", "released_at", "fraction"))


def _attained_gpu_s() -> dict[int, float]:
    """GPU-seconds each queued or running job got from its earlier attempts (the las policy
    orders and preempts by it; the core adds a running attempt's own service)."""
    out: dict[int, float] = defaultdict(float)
    for job_id, started, released, fraction in _EARLIER_ATTEMPTS.rows():
        out[job_id] += max((released - started).total_seconds(), 0.0) * float(fraction)
    return out


NODE_STATES = (NodeState.READY, NodeState.DRAINING)
NODE_FIELDS = ("name", "pool", "state", "sandbox", "queue_verified_at", "cpus", "memory_mb", "cached_datasets")
GPU_FIELDS = ("id", "node__name", "index", "model", "memory_mb", "health", "mode")
# And its topology, NULL where none was reported: only the GPUs with one have their JSON decoded.
GPU_TOPOLOGY = NullIf("topology", Value({}, output_field=JSONField()))
# What the snapshot reads of a job as it is stored; JOB_TIMES below adds the columns it reads computed.
JOB_FIELDS = ("id", "project__slug", "project__organization__slug", "user__username", "gpus", "time_limit_s",
              "gpu_type", "gpu_memory_mb", "priority", "preemptible", "array_parent_id", "array_limit", "sandbox",
              "nodes", "cpus", "memory_mb", "node__name", "checkpoint_signal", "checkpoint_grace_s",
              "checkpoint_interval_s")
# Read as computed columns: times as epoch floats (Epoch), and datasets and avoided nodes as NULL where
# there are none (most jobs), so only the jobs naming some have their JSON decoded.
JOB_TIMES = {"submit_s": Epoch("submitted_at"), "changed_s": Epoch("state_changed_at"),
             "datasets_or_none": NullIf("datasets", Value([], output_field=JSONField())),
             "avoid_or_none": NullIf("avoid_nodes", Value({}, output_field=JSONField()))}
ALLOCATION_FIELDS = ("job_id", "gpu_id", "fraction", "shared", "borrowed")


def _nodes():
    return Node.objects.filter(state__in=NODE_STATES)


def _gpus():
    return GPU.objects.filter(node__state__in=NODE_STATES)


def _holding_jobs():
    return Job.objects.filter(state__in=HOLDING, is_array_parent=False)


def _queued_jobs(now):
    # A held job (jobs.services.job_hold) is not in the snapshot: it keeps its `held` reason; nor is
    # one whose last attempt is still saving its checkpoint (states.requeue_holding).
    return Job.objects.filter(state=JobState.QUEUED, is_array_parent=False, held=False).exclude(resume_after__gt=now)


def _open_allocations():
    return Allocation.objects.filter(released_at__isnull=True)


def _blocking_dependencies():
    return Job.depends_on.through.objects.filter(from_job__state=JobState.QUEUED).exclude(
        to_job__state=JobState.SUCCEEDED)


# A datetime that stands for the pass's `now` in the prepared reads (portal/core/prepared.py): they
# find its place among the parameters by identity, so any fresh object does.
_NOW = datetime.fromtimestamp(0, tz=UTC)
_SNAPSHOT_NODES = Prepared(lambda: _nodes().values_list(*NODE_FIELDS, "id", "protocol_version"))
_SNAPSHOT_GPUS = Prepared(lambda: _gpus().values_list(*GPU_FIELDS, GPU_TOPOLOGY))
_SNAPSHOT_HOLDING = Prepared(lambda: _holding_jobs().values(*JOB_FIELDS, **JOB_TIMES))
_SNAPSHOT_ALLOCATIONS = Prepared(lambda: _open_allocations().values_list(*ALLOCATION_FIELDS, Epoch("started_at")))
_SNAPSHOT_BLOCKED = Prepared(lambda: _blocking_dependencies().values_list("from_job_id", flat=True))
_SNAPSHOT_QUEUED = Prepared(lambda now: _queued_jobs(now).order_by("submitted_at", "id").values(
    *JOB_FIELDS, "reason_code", "reason_message", "queue_position", **JOB_TIMES), now=_NOW)
# The quotas and organizations of the projects with jobs in the snapshot (their slugs).
_SNAPSHOT_QUOTAS = Prepared(lambda slugs: Quota.objects.filter(AnyOf(F("project__slug"), slugs)).values_list(
    "project__slug", "project_id", "project__organization__slug", "guaranteed_gpus", "max_gpus", "max_running_jobs",
    "max_time_limit_s", "gpu_hours_budget", "budget_hard_stop", "allowed_gpu_types"), slugs=[])
_SNAPSHOT_ORGS = Prepared(lambda slugs: Organization.objects.filter(AnyOf(F("projects__slug"), slugs)).distinct()
                          .values_list("slug", "max_gpus"), slugs=[])


def build_snapshot(now=None):
    """Returns (snapshot, context) where context maps core ids back to rows."""
    now = now or timezone.now()
    # Every node that may hold jobs, GPUs or not: each job's CPUs and memory count against its node's.
    node_rows = _SNAPSHOT_NODES.rows()
    nodes: dict[str, core.Node] = {
        name: core.Node(name=name, pool=pool, gpus=[], sandbox=sandbox, cpus=float(cpus), memory_mb=memory,
                        # New jobs only where the agent has proved it receives its queue (Node.schedulable).
                        schedulable=node_state == NodeState.READY and verified is not None,
                        datasets=frozenset(cached or ()))  # its agent's cache (dataset locality)
        for name, pool, node_state, sandbox, verified, cpus, memory, cached, _, _ in node_rows}
    gpu_node: dict[str, str] = {}
    core_gpus: dict[str, core.GPU] = {}
    for gid, node_name, index, model, memory, health, mode, topo in _SNAPSHOT_GPUS.rows():
        node = nodes.get(node_name)
        if node is None:  # a node that turned ready between the two reads: its jobs wait for the next pass
            continue
        gid = str(gid)
        gpu = core.GPU(id=gid, node=node_name, index=index, model=model, memory_mb=memory,
                       healthy=health == GPUHealth.HEALTHY, shared=mode == GPUMode.SHARED, sandbox=node.sandbox,
                       topo=_topo(topo))
        node.gpus.append(gpu)
        gpu_node[gid] = node_name
        core_gpus[gid] = gpu

    config = config_from_settings()
    now_s = now.timestamp()
    attained = _attained_gpu_s() if config.policy == "las" else {}  # only las reads it
    qos = QOS_VALUE

    def to_core(row, deps_ok=True) -> core.Job:
        job_id = row["id"]
        return core.Job(
            id=str(job_id), project=row["project__slug"], org=row["project__organization__slug"],
            user=row["user__username"], gpus=float(row["gpus"]), submit_time=row["submit_s"],
            time_limit=float(row["time_limit_s"]), gpu_type=row["gpu_type"] or None,
            gpu_memory_mb=row["gpu_memory_mb"], qos=qos[row["priority"]], preemptible=row["preemptible"],
            array_parent=str(row["array_parent_id"]) if row["array_parent_id"] else None,
            array_limit=row["array_limit"], deps_satisfied=deps_ok, sandbox=row["sandbox"], nodes=row["nodes"],
            attained_gpu_s=attained.get(job_id, 0.0), cpus=float(row["cpus"]), memory_mb=row["memory_mb"],
            checkpoint_grace_s=float(row["checkpoint_grace_s"] or 0) if row["checkpoint_signal"] else None,
            # A job that says it saves every interval_s is taken as keeping only those saves (its
            # signal's save may not finish in its grace), as the simulator replays it.
            checkpoint_interval_s=float(row["checkpoint_interval_s"])
            if row["checkpoint_signal"] and row["checkpoint_interval_s"] else None,
            datasets=_core_datasets(row["datasets_or_none"]),
            avoid_nodes=_avoided(row["avoid_or_none"], now_s),
        )

    holding = {row["id"]: row for row in _SNAPSHOT_HOLDING.rows()}
    allocs: dict[int, list] = defaultdict(list)
    for job_id, gpu_id, fraction, shared, borrowed, started in _SNAPSHOT_ALLOCATIONS.rows():
        allocs[job_id].append((str(gpu_id), float(fraction), shared, borrowed, started))
    running = []
    for job_id, row in holding.items():
        rows = allocs.get(job_id, [])
        start = min((r[4] for r in rows), default=row["changed_s"])
        running.append(core.Allocation(
            job=to_core(row), gpu_ids=[r[0] for r in rows], start_time=start,
            fractions={r[0]: r[1] for r in rows if r[2]}, borrowed=any(r[3] for r in rows),
            node=None if rows else row["node__name"]))

    blocked = set(_SNAPSHOT_BLOCKED.rows())
    queued_rows = _SNAPSHOT_QUEUED.rows(now=now)
    queued = []
    for row in queued_rows:
        job = to_core(row, deps_ok=row["id"] not in blocked)
        job.queued_since = row["changed_s"]  # submit, or its requeue after preemption
        queued.append(job)

    project_slugs = list({j.project for j in queued} | {a.job.project for a in running})
    quotas = _SNAPSHOT_QUOTAS.rows(slugs=project_slugs)
    project_ids = {q[0]: q[1] for q in quotas}
    used_hours, usage = usage_for_pass(project_ids.values(), half_life_s=settings.SCHEDULER_FAIRSHARE_HALF_LIFE_S,
                                       now=now)
    projects = {}
    for slug, project_id, org, guaranteed, max_gpus, max_running, max_time, budget, hard_stop, types in quotas:
        projects[slug] = core.ProjectQuota(
            project=slug, org=org, guaranteed_gpus=float(guaranteed),
            max_gpus=float(max_gpus), max_running_jobs=max_running, max_time_limit=float(max_time),
            # Only a hard stop holds jobs already queued; otherwise the budget is checked at submit.
            gpu_hours_budget=float(budget) if hard_stop and budget is not None else None,
            gpu_hours_used=used_hours.get(project_id, 0.0),
            allowed_gpu_types=tuple(types or ()),
        )
    orgs = {slug: core.OrgQuota(org=slug, max_gpus=float(max_gpus) if max_gpus is not None else None)
            for slug, max_gpus in _SNAPSHOT_ORGS.rows(slugs=project_slugs)}
    snapshot = core.Snapshot(
        now=_epoch(now), nodes=list(nodes.values()), running=running, queued=queued, projects=projects, orgs=orgs,
        usage={slug: usage.get(pid, 0.0) for slug, pid in project_ids.items()}, config=config,
    )
    context = {"gpu_node": gpu_node, "gpus": core_gpus, "queued": {str(r["id"]): r for r in queued_rows}, "holding": holding,
               # Node ids for the starts, and which agents take batched launches (_publish).
               "node_ids": {row[0]: row[8] for row in node_rows},
               "protocols": {row[0]: row[9] for row in node_rows}}
    return snapshot, context


def _columns(lookups) -> tuple[str, ...]:
    """The job's own columns behind snapshot lookups: "project__slug" is read as the project's id
    (the projects themselves are digested apart)."""
    return tuple(dict.fromkeys(name.split("__")[0] for name in lookups))


def inputs_digest(now, config: core.Config) -> str | None:
    """A digest of every row the snapshot reads, with the config: two passes over equal digests
    plan the same (but for time). PostgreSQL hashes the rows where they are (one statement, no
    row comes to Python; a few tens of ms for 10,000 waiting jobs); None elsewhere. Reasons and
    positions are what a pass writes, not what it reads, so they are left out."""
    if connection.vendor != "postgresql":
        return None
    rows = _DIGEST.rows(now=now)
    return hashlib.sha256(repr((rows, config)).encode()).hexdigest()


def _digest_sql(now) -> tuple[str, list]:
    """inputs_digest's statement: one count and hash sum per source, in one round trip."""
    job_columns = _columns(JOB_FIELDS) + ("submitted_at", "state_changed_at", "datasets", "avoid_nodes")
    sources = [
        _nodes().values_list(*NODE_FIELDS),
        _gpus().values_list(*_columns(GPU_FIELDS), "topology"),
        _holding_jobs().values_list(*job_columns, "state", "attempt"),
        _queued_jobs(now).values_list(*job_columns),
        _open_allocations().values_list(*ALLOCATION_FIELDS, "started_at"),
        _blocking_dependencies().values_list("from_job_id", "to_job_id"),
        Quota.objects.values_list(*(f.attname for f in Quota._meta.concrete_fields)),
        Project.objects.values_list("id", "slug", "organization_id"),
        Organization.objects.values_list("id", "slug", "max_gpus"),
        get_user_model().objects.values_list("id", "username"),
        ProjectMonthUsage.objects.values_list("project_id", "month", "gpu_s"),
        ProjectFairshare.objects.values_list(*(f.attname for f in ProjectFairshare._meta.concrete_fields)),
    ]
    parts, params = [], []
    for qs in sources:
        sql, p = qs.order_by().query.sql_with_params()
        parts.append(f"SELECT count(*), coalesce(sum(hash_record_extended(t, 0)), 0) FROM ({sql}) t")
        params += p
    return " UNION ALL ".join(parts), params


_DIGEST = Prepared(_digest_sql, now=_NOW)


def _topo(reported: dict | None) -> tuple | None:
    """GPU.topology (what the probe read) as the core's (nvlink, pcie, numa) domains."""
    if not reported:
        return None
    return tuple(reported.get(level) for level in core.TOPO_LEVELS[:-1])


def _placement_topology(start: core.Start, context) -> str:
    """The Job.placement_topology of a start: its topology score's name, or "" when not known."""
    gpus = context["gpus"]
    level = core.topo_score([gpus[g] for g in start.gpu_ids if g in gpus])
    return "" if level is None else core.TOPO_LEVELS[level]


_LATE_RELEASES = Prepared(lambda now: Allocation.objects.filter(released_at__gt=now).values_list(
    "gpu_id", "released_at"), now=_NOW)


def _start_times(starts, now) -> dict[str, object]:
    """When each start's allocations begin: the apply time, or the previous holder's release if
    that is later (a release committed after this pass began, or stamped by a web process whose
    clock runs ahead). A whole GPU's allocations then never overlap, and billed GPU time equals
    allocated time. Only releases after `now` matter, a handful found through their index."""
    late: dict[str, object] = {}
    for gpu_id, released in _LATE_RELEASES.rows(now=now):
        late[str(gpu_id)] = max(released, late.get(str(gpu_id), released))
    return {s.job_id: max([now, *(late[g] for g in s.gpu_ids if g in late)]) for s in starts}


def _apply_start(start: core.Start, context, start_time) -> tuple[list[str], int] | None:
    """Assign one job; returns (its node names, attempt), or None when the database refused it."""
    job_id = int(start.job_id)
    gpu_ids = [int(g) for g in start.gpu_ids]
    # Nodes in the order of the job's GPUs: the first is the rendezvous master of a gang.
    node_names = list(dict.fromkeys(context["gpu_node"][g] for g in start.gpu_ids))
    if not node_names:
        node_names = [start.node]  # a CPU-only job: the core picked a node with room for it
    try:
        with transaction.atomic():
            shared = set(GPU.objects.filter(pk__in=gpu_ids, mode=GPUMode.SHARED).values_list("pk", flat=True))
            if shared:
                # Row locks serialize fraction sums on a shared GPU (no unique index can express "sum <= 1").
                list(GPU.objects.select_for_update().filter(pk__in=shared))
                for gpu_id in shared:
                    taken = Allocation.objects.filter(gpu_id=gpu_id, released_at__isnull=True).aggregate(
                        s=Sum("fraction"))["s"] or Decimal(0)
                    if taken + Decimal(str(start.fractions.get(str(gpu_id), 1))) > 1:
                        raise IntegrityError(f"shared GPU {gpu_id} is full")
            node_id = Node.objects.filter(name=node_names[0]).values_list("pk", flat=True).first()
            if not transition(job_id, to=JobState.ASSIGNED, from_states={JobState.QUEUED}, node_id=node_id,
                              reason_code="", reason_message="", queue_position=None,
                              placement_topology=_placement_topology(start, context),
                              message=f"Assigned to {', '.join(node_names)}"):
                return None
            attempt = Job.objects.values_list("attempt", flat=True).get(pk=job_id)
            Allocation.objects.bulk_create([
                Allocation(job_id=job_id, attempt=attempt, gpu_id=g, shared=g in shared,
                           fraction=Decimal(str(start.fractions.get(str(g), 1))) if g in shared else Decimal(1),
                           borrowed=start.borrowed, started_at=start_time)
                for g in gpu_ids
            ])
    except IntegrityError as exc:
        log.warning("start of job %s refused by the database: %s", job_id, exc)
        return None
    return node_names, attempt


_SHARED_GPUS = Prepared(lambda: GPU.objects.filter(mode=GPUMode.SHARED).values_list("pk", flat=True))


def _apply_whole_starts(starts, context, start_times):
    """Apply the starts that need no row lock (whole GPUs) in bulk; return (launches, the rest).

    Shared-GPU and CPU-only starts go through _apply_start one by one. If the database
    refuses the bulk insert (a double-booked GPU), the savepoint rolls back and every start
    is retried one by one, so only the offending job stays queued.
    """
    shared = context.setdefault("shared_gpus", {str(g) for g in _SHARED_GPUS.rows()})
    bulk = [s for s in starts if s.gpu_ids and not shared.intersection(s.gpu_ids)]
    rest = [s for s in starts if not (s.gpu_ids and not shared.intersection(s.gpu_ids))]
    if not bulk:
        return [], rest
    node_ids = context["node_ids"]  # the snapshot's nodes: the only ones the core places on
    by_job = {int(s.job_id): s for s in bulk}
    first_node = {job_id: context["gpu_node"][s.gpu_ids[0]] for job_id, s in by_job.items()}
    try:
        with transaction.atomic():
            moved = assign_many({j: (node_ids[n], _placement_topology(by_job[j], context))
                                 for j, n in first_node.items()},
                                message_for=lambda j: "Assigned to " + ", ".join(
                                    dict.fromkeys(context["gpu_node"][g] for g in by_job[j].gpu_ids)))
            allocate_whole_gpus([(job_id, attempt, int(g), by_job[job_id].borrowed, start_times[str(job_id)])
                                for job_id, attempt in moved.items() for g in by_job[job_id].gpu_ids])
    except IntegrityError as exc:
        log.warning("bulk start refused by the database (%s); retrying one by one", exc)
        return [], starts
    launches = [(name, job_id, attempt) for job_id, attempt in moved.items()
                for name in dict.fromkeys(context["gpu_node"][g] for g in by_job[job_id].gpu_ids)]
    return launches, rest


def _apply_preemption(pre: core.Preemption, context) -> list[tuple] | None:
    """Requeue a preempted job as its next attempt; returns its stops (node, job, attempt, grace,
    signal): a checkpointing job gets its signal and grace to save, any other SIGTERM."""
    job_id = int(pre.job_id)
    row = Job.objects.filter(pk=job_id, state__in=HOLDING).values("attempt").first()
    if row is None:
        return None
    message = f"Preempted by job {pre.by_job_id}: {pre.reason}"
    return requeue_holding(job_id, attempt=row["attempt"], reason_code="preempted", message=message,
                           via=JobState.PREEMPTED)


# Functions (job ids -> {job id: note}) whose notes lead the reason of a job waiting for capacity:
# the autoscaler registers one ("scaling up pool h100: node h100-7 booting (45 s)"), so this module
# imports nothing above it (portal/autoscale/apps.py).
REASON_NOTES: list = []


def _notes(plan: core.Plan) -> dict[str, str]:
    ids = [j for j, r in plan.waiting.items() if wants_capacity(r)]
    notes: dict[str, str] = {}
    for source in REASON_NOTES if ids else ():
        try:
            notes.update(source(ids))
        except Exception:  # a note is a courtesy: it never fails a pass
            log.exception("reason notes from %r failed", source)
    return notes


def _write_reasons(plan: core.Plan, context) -> int:
    """Write the reasons and positions that changed since the job's row was read; returns how many."""
    changed = []
    notes = _notes(plan)
    queued = context["queued"]
    for job_id, reason in plan.waiting.items():
        row = queued.get(job_id)
        if row is None:
            continue
        message = (f"{notes[job_id]}. {reason.message}" if job_id in notes else reason.message)[:300]
        if (row["reason_code"], row["reason_message"], row["queue_position"]) != (reason.code, message, reason.position):
            changed.append((row["id"], reason.code, message, reason.position))
    context["notes"] = bool(notes)
    # Only queued rows: a job cancelled meanwhile keeps its own reason.
    if connection.vendor == "postgresql":
        _update_reasons(changed)
    else:
        for job_id, code, message, position in changed:
            Job.objects.filter(pk=job_id, state=JobState.QUEUED).update(
                reason_code=code, reason_message=message, queue_position=position)
    return len(changed)


def _update_reasons(changed: list[tuple[int, str, str, int | None]]) -> None:
    """(id, code, message, position) rows in one UPDATE ... FROM unnest(arrays) per 5,000 rows, a
    few parameters whatever the count. Thousands of waiting jobs share a few tens of reasons: each
    distinct one is sent once and rows name it by its index, so a first pass sends integers, not
    7,907 messages of a hundred characters each to quote and parse."""
    table = Job._meta.db_table
    for i in range(0, len(changed), 5000):
        ids, codes, messages, positions = zip(*changed[i:i + 5000])
        distinct = {reason: k for k, reason in enumerate(dict.fromkeys(zip(codes, messages)), start=1)}
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} AS j SET reason_code = (%s::text[])[v.k], reason_message = (%s::text[])[v.k], "
                f"queue_position = v.pos FROM unnest(%s::bigint[], %s::integer[], %s::integer[]) AS v(id, k, pos) "
                f"WHERE j.id = v.id AND j.state = %s",
                [[code for code, _ in distinct], [message for _, message in distinct], list(ids),
                 [distinct[reason] for reason in zip(codes, messages)], list(positions), JobState.QUEUED])


_STALE_LAUNCHES = Prepared(lambda cutoff: Job.objects.filter(
    state__in=[JobState.ASSIGNED, JobState.STARTING], state_changed_at__lt=cutoff).values_list(
    "id", "attempt", "node__name"), cutoff=_NOW)
_GANG_NODES = Prepared(lambda ids: Allocation.objects.filter(
    AnyOf(F("job_id"), ids), released_at__isnull=True).values_list("job_id", "gpu__node__name"), ids=[])


def _resend_stale_launches(now) -> list[tuple[str, int, int]]:
    """Jobs assigned or starting for LAUNCH_RESEND_S and not yet running: the launch may have been
    lost after commit, or with an agent that died while it waited for GPUs.

    Fencing makes a duplicate harmless: the agent confirms (job, attempt) before starting, and
    one it is already launching or running is a no-op there. A launch still lost after
    LAUNCH_LOST_S is requeued from the node's heartbeat (portal/agentapi/heartbeat.py).
    """
    cutoff = now - timedelta(seconds=settings.LAUNCH_RESEND_S)
    stale = {row[0]: row for row in _STALE_LAUNCHES.rows(cutoff=cutoff)}
    out = []
    if not stale:
        return out
    gang_nodes = defaultdict(set)
    for job_id, node_name in _GANG_NODES.rows(ids=list(stale)):
        gang_nodes[job_id].add(node_name)
    for job_id, attempt, node_name in stale.values():
        for name in sorted(gang_nodes.get(job_id) or {node_name}):
            if name:
                out.append((name, job_id, attempt))
    return out


# Folding released allocations into the usage totals (portal/jobs/usage.py) is a saving, not a
# need: the snapshot's readers add the allocations not folded yet from the rows themselves, so
# they are exact either way. It keeps those rows few, and a few seconds' worth are few, so a pass
# folds at most every USAGE_FOLD_INTERVAL_S (per process), as Slurm's controller recomputes usage
# every PriorityCalcPeriod rather than on every job end: under a stream of short jobs a fold in
# every pass was a fifth of its CPU. Every second, not every 5: the submit's budget check sums the
# rows not folded yet, and a second's worth cost it 0.31 ms of PostgreSQL where 5 s cost 0.46
# (bench/pg_statements.py).
USAGE_FOLD_INTERVAL_S = 1.0
_last_fold = {"at": -math.inf}


def _usage_fold_when_due() -> None:
    at = time.monotonic()
    if at - _last_fold["at"] >= USAGE_FOLD_INTERVAL_S:
        usage_fold()
        _last_fold["at"] = at


# The last full pass that changed nothing but reasons: the digest of what it read, until when its
# plan stands, and its counts (inputs_digest, run_pass). In the shared cache: any worker may pass next.
LAST_PLAN = "scheduler:last-plan"


def _notes_quiet() -> bool:
    """Whether no source of reason notes has any to give: a source may say so through a `quiet`
    attribute (a function); one without it is taken as having some."""
    for source in REASON_NOTES:
        quiet = getattr(source, "quiet", None)
        try:
            if quiet is None or not quiet():
                return False
        except Exception:
            log.exception("reason notes from %r failed", source)
            return False
    return True


def _plan_stands(digest: str | None, now) -> dict | None:
    """The last plan's record when this pass would plan the same: nothing the snapshot reads has
    changed since it (the digest), no time-driven change is due (`until`) and no reason note is
    pending. Slurm's controller skips its backfill cycle on the same grounds (no job, node or
    partition update since the last one)."""
    if digest is None:
        return None
    last = cache.get(LAST_PLAN)
    if not last or last.get("digest") != digest or _epoch(now) >= min(
            last["at"] + settings.SCHEDULER_REPLAN_S, last["due"] or math.inf):
        return None
    return last if _notes_quiet() else None


def _plan_record(digest: str | None, now, plan: core.Plan, context, queued: int) -> dict | None:
    """What a later pass needs to reuse this plan, or None when it may not: a plan that starts or
    preempts anything changes what the next pass reads, and a note may change by itself."""
    if digest is None or plan.starts or plan.preemptions or context.get("notes"):
        return None
    # Time changes a plan too (ages, minimum runtimes, las queues, budgets, locality waits): a
    # full pass every SCHEDULER_REPLAN_S at least, and at the next instant the core names.
    due = [t for t in (getattr(plan, "next_pass_at", None), *plan.locality_waits.values(),
                       *_avoid_ends(context, _epoch(now))) if t is not None]
    return {"digest": digest, "at": _epoch(now), "due": min(due, default=None), "waiting": len(plan.waiting),
            "fragmented": len(plan.fragmented), "queued": queued}


def run_pass(*, wait: bool = False, task_id: str | None = None) -> dict:
    """One scheduling pass (see the module docstring for the steps). With `wait` (the task), a
    pass that finds another running waits for it instead of returning: a requested pass is never
    dropped, and requests coalesce before they are queued (portal/core/passes.py); `task_id`: the
    task's, which tells a requested pass from beat's."""
    t0 = time.perf_counter()
    launches: list[tuple[str, int, int]] = []
    stops: list[tuple[str, int, int, int, str | None]] = []
    published = {"s": 0.0}
    prefetch: dict[str, list[core.Dataset]] = {}
    protocols: dict[str, str] = {}

    def publish():
        t = time.perf_counter()
        _publish(launches, stops, prefetch, protocols)
        published["s"] = time.perf_counter() - t

    with transaction.atomic():
        if wait:
            locks.xact_lock(locks.SCHEDULE_PASS)
        elif not locks.try_xact_lock(locks.SCHEDULE_PASS):
            return {"skipped": "another scheduling pass is running"}
        pass_begins(task_id)  # requests from now on ask for the next pass
        now = timezone.now()
        cancelled = _cancel_failed_dependents()
        _usage_fold_when_due()
        config = config_from_settings()
        digest = inputs_digest(now, config)
        last = _plan_stands(digest, now)
        if last is not None:
            # Nothing changed: the last plan stands and its reasons are in place. Only lost launches.
            launches += _resend_stale_launches(now)
            t_applied = time.perf_counter()
            transaction.on_commit(publish)
            log.debug("scheduling pass: nothing changed, %d waiting", last["waiting"])
            return {
                "started": 0, "preempted": 0, "waiting": last["waiting"], "fragmented": last["fragmented"],
                "placements_by_topology": {}, "reasons_written": 0, "dependents_cancelled": cancelled,
                "queued": last["queued"], "unchanged": True,
                "build_s": round(t_applied - t0, 4), "core_s": 0.0, "apply_s": 0.0,
                "commit_publish_s": 0.0, "publish_s": 0.0, "total_s": round(time.perf_counter() - t0, 4),
            }
        snapshot, context = build_snapshot(now)
        protocols.update(context["protocols"])
        t_built = time.perf_counter()
        crashpoint("schedule.after_snapshot")
        plan = core.schedule(snapshot)
        prefetch.update(plan.prefetch)
        t_planned = time.perf_counter()
        for pre in plan.preemptions:
            stops += _apply_preemption(pre, context) or []
        started = 0
        rest = plan.starts
        start_times = _start_times(plan.starts, timezone.now()) if plan.starts else {}
        if connection.vendor == "postgresql":
            done, rest = _apply_whole_starts(plan.starts, context, start_times)
            started += len({job_id for _, job_id, _ in done})  # a gang has one launch per node
            launches += done
        for start in rest:
            done = _apply_start(start, context, start_times[start.job_id])
            if done is not None:
                started += 1
                nodes, attempt = done
                launches += [(n, int(start.job_id), attempt) for n in nodes]
        reasons = _write_reasons(plan, context)
        crashpoint("schedule.before_commit")
        launches += _resend_stale_launches(now)
        t_applied = time.perf_counter()
        record = _plan_record(digest, now, plan, context, len(snapshot.queued))
        transaction.on_commit(publish)
        # Kept only once committed; and a pass that does not keep one forgets the one before.
        transaction.on_commit(lambda: cache.set(LAST_PLAN, record, timeout=settings.SCHEDULER_REPLAN_S)
                              if record else cache.delete(LAST_PLAN))
    t_published = time.perf_counter()
    # A pass that changed something is news; the idle ones (every few seconds) are not.
    log.log(logging.INFO if started or plan.preemptions or cancelled else logging.DEBUG,
            "scheduling pass: %d started, %d preempted, %d waiting, %d cancelled (dependency failed)",
            started, len(plan.preemptions), len(plan.waiting), cancelled)
    return {
        "started": started, "preempted": len(plan.preemptions), "waiting": len(plan.waiting),
        "fragmented": len(plan.fragmented),
        # Multi-GPU starts by how closely their GPUs are linked (the core's topology score).
        "placements_by_topology": dict(Counter(t for t in (_placement_topology(s, context) for s in plan.starts) if t)),
        "reasons_written": reasons, "dependents_cancelled": cancelled, "queued": len(snapshot.queued),
        "build_s": round(t_built - t0, 4), "core_s": round(t_planned - t_built, 4),
        "apply_s": round(t_applied - t_planned, 4), "commit_publish_s": round(t_published - t_applied, 4),
        "publish_s": round(published["s"], 4), "total_s": round(time.perf_counter() - t0, 4),
    }


_PROTOCOLS = Prepared(lambda names: Node.objects.filter(AnyOf(F("name"), names)).values_list(
    "name", "protocol_version"), names=[])


def _publish(launches, stops, prefetch=None, protocols=None) -> None:
    """`protocols`: the agents' protocol versions by node name as the snapshot read them; the
    nodes of re-sent launches it lacks are read here."""
    crashpoint("schedule.after_commit_before_publish")
    for node_name, job_id, attempt, grace, signal in stops:
        send_stop(node_name, job_id, attempt, "preempted", grace, signal)
    if launches:
        versions = dict(protocols or {})
        unknown = {node for node, _, _ in launches} - versions.keys()
        if unknown:
            versions.update(_PROTOCOLS.rows(names=list(unknown)))
        batched = {name for name, version in versions.items() if speaks(version, LAUNCHES_SINCE)}
        send_launches(launches, launch_specs([(node, job_id) for node, job_id, _ in launches]), batched)
    if prefetch:
        _send_prefetch(prefetch)


def _send_prefetch(prefetch: dict[str, list[core.Dataset]]) -> int:
    """`agent.prefetch` to nodes reserved for jobs whose datasets they lack (the plan's `prefetch`):
    each (node, dataset) at most once per SCHEDULER_PREFETCH_HORIZON_S, since every pass asks again
    while the reservation stands (a duplicate is harmless: the agent's cache fetches once).
    Returns how many datasets were asked for."""
    asked, ttl = 0, settings.SCHEDULER_PREFETCH_HORIZON_S
    for node_name, datasets in prefetch.items():
        new = [d.digest for d in datasets if cache.add(f"scheduler:prefetch:{node_name}:{d.digest}", 1, timeout=ttl)]
        entries = prefetch_entries(new) if new else []
        if entries:
            send_prefetch(node_name, entries)
            asked += len(entries)
    return asked
