"""Autoscaling decisions, pure: a scheduling plan and the pools' nodes in, nodes to add and release out.

The Celery task (portal/autoscale/services.py) and the simulator (scheduler/sim/autoscale.py) run
this same function after a scheduling pass, as the scheduler core itself is shared
(docs/autoscaling.md). Nothing here imports Django.

Scale-up: the waiting jobs the pass could not start for lack of capacity (CAPACITY_CODES) are
*demand*, unless the backfill plan gives them a reservation that starts before a new node could
boot (`boot_estimate_s`): an existing node takes them soon. Each demand job goes to the cheapest
pool whose shape can hold it; it is first packed onto capacity that comes soon anyway (nodes
of the pool still booting, GPUs of running jobs whose time limit ends within the boot estimate),
then onto new nodes of the pool's shape (first fit). The count is then capped by the pool's
maximum, its maximum per step, its cost cap per hour and the remaining GPU-hour budgets of the
projects whose jobs asked for the nodes. A pool in provider back-off (`available` False) adds
nothing. Every demand job gets a note saying what is being done for it.

Scale-down: a ready node of a pool, idle (no job) for the pool's `idle_release_s`, is released,
the longest idle first, never below `min_nodes`, at most `max_concurrent_releases` at once, and
not while jobs the pool could serve still wait. The caller drains it under the scheduling lock
and checks again that it holds no job before the provider deletes it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .model import (
    REASON_FRAGMENTED, REASON_GPU_TYPE, REASON_NODE_RESOURCES, REASON_PRIORITY, REASON_RESERVATION,
    REASON_RESOURCES, REASON_SANDBOX, REASON_UNPLACEABLE, Plan, Reason, Snapshot, sandbox_hosts,
)

# Waiting for GPUs the cluster does not have free: more nodes would help. Quota, budget, type,
# dependency and array waits are the tenant's own limits: no node helps those.
CAPACITY_CODES = frozenset({REASON_RESOURCES, REASON_FRAGMENTED, REASON_UNPLACEABLE, REASON_NODE_RESOURCES,
                            REASON_RESERVATION, REASON_PRIORITY, REASON_SANDBOX})
NO_SUCH_TYPE = "No schedulable GPU of type"  # admission's gpu_type wait when no node has the type (yet)


def wants_capacity(reason: Reason) -> bool:
    """Would more nodes help this waiting job? (a pool must still offer its shape)"""
    return reason.code in CAPACITY_CODES or (reason.code == REASON_GPU_TYPE and reason.message.startswith(NO_SUCH_TYPE))

BOOTING, READY, RELEASING = "booting", "ready", "releasing"


@dataclass
class PoolSpec:
    """A pool's shape and limits (portal.autoscale.models.NodePool)."""

    name: str
    gpu_model: str
    gpus_per_node: int
    price_per_gpu_hour: float = 0.0
    gpu_memory_mb: int = 0
    min_nodes: int = 0
    max_nodes: int = 8
    max_per_step: int = 4
    idle_release_s: float = 600.0
    boot_estimate_s: float = 120.0  # how long a new node takes to take jobs: "soon" for existing capacity
    max_concurrent_releases: int = 2
    max_cost_per_hour: float | None = None  # price x GPUs of all its nodes may not pass this
    sandbox: str = ""  # what its nodes' agents run ("" counts as the default sandbox)
    available: bool = True  # False while the provider is backed off (out of stock, errors)
    unavailable_note: str = ""


@dataclass
class PoolNode:
    name: str
    pool: str
    state: str  # booting | ready | releasing
    created_at: float
    idle_since: float | None = None  # ready and holding no job since then; None while busy
    jobs: list[str] = field(default_factory=list)  # booting: the jobs it was started for


@dataclass
class PoolUp:
    pool: str
    nodes: int  # new nodes to create
    jobs: list[list[str]]  # per new node, the jobs it is for
    wanted: int  # nodes the demand needed before the limits
    limited_by: str = ""


@dataclass
class ScalePlan:
    up: dict[str, PoolUp] = field(default_factory=dict)
    on_booting: dict[str, list[str]] = field(default_factory=dict)  # booting node -> jobs it will take
    release: list[str] = field(default_factory=list)
    # Consolidation: node -> the jobs to move off it (to free nodes of the pool) so it can be released.
    consolidate: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # job id -> why it waits (limits, back-off)
    demand_gpus: dict[str, float] = field(default_factory=dict)  # pool -> GPUs of its demand jobs


def model_matches(gpu_type: str | None, model: str) -> bool:
    """A job's gpu_type "H100" or "H100-80GB" against a pool's model "H100-80GB"."""
    return not gpu_type or gpu_type == model or model.startswith(gpu_type + "-")


def pool_fits(job, pool: PoolSpec) -> bool:
    if job.gpus <= 0 or job.gpus < 1:  # CPU-only and fractional jobs: no GPU pool is scaled for them
        return False
    per_node = job.gpus_per_node if job.nodes > 1 else int(math.ceil(job.gpus))
    if per_node > pool.gpus_per_node or job.nodes > pool.max_nodes:
        return False
    if job.gpu_memory_mb and pool.gpu_memory_mb and job.gpu_memory_mb > pool.gpu_memory_mb:
        return False
    return model_matches(job.gpu_type, pool.gpu_model) and pool.sandbox in sandbox_hosts(job.sandbox)


def _fit(parts: list[int], bins: list[list], start: int = 0) -> bool:
    """Place each part (GPUs on one node) in a distinct bin with room (first fit); bins are
    [name, free]. All or nothing."""
    chosen: list[int] = []
    for need in parts:
        for i in range(start, len(bins)):
            if i not in chosen and bins[i][1] >= need:
                chosen.append(i)
                break
        else:
            return False
    for i, need in zip(chosen, parts):
        bins[i][1] -= need
    return True


def _parts(job) -> list[int]:
    return [job.gpus_per_node] * job.nodes if job.nodes > 1 else [int(math.ceil(job.gpus))]


def autoscale(snapshot: Snapshot, plan: Plan, pools: list[PoolSpec], nodes: list[PoolNode],
              budgets: dict[str, float | None] | None = None, now: float | None = None,
              movable: set[str] | frozenset = frozenset()) -> ScalePlan:
    """What to add and release after this pass. `budgets`: remaining GPU-hours this month per
    project (None or absent: no budget). `movable`: running jobs that may be moved to consolidate
    (they checkpoint and are not marked do-not-disrupt)."""
    now = snapshot.now if now is None else now
    out = ScalePlan()
    budgets = dict(budgets or {})
    by_pool = {p.name: p for p in pools}
    live = {p.name: 0 for p in pools}
    releasing = {p.name: 0 for p in pools}
    for n in nodes:
        if n.pool in live:
            live[n.pool] += n.state != RELEASING
            releasing[n.pool] += n.state == RELEASING
    reserved_at = {r.job_id: r.start_time for r in plan.reservations}
    queued = {j.id: j for j in snapshot.queued}
    waiting = sorted(((r.position, jid) for jid, r in plan.waiting.items()
                      if wants_capacity(r) and jid in queued), key=lambda x: (x[0], x[1]))

    # Capacity that comes soon without a new node: booting nodes, and GPUs of running jobs whose
    # time limit ends within the pool's boot estimate (the backfill plan's own estimate).
    soon: dict[str, list[list]] = {p.name: [] for p in pools}
    for n in nodes:
        if n.state == BOOTING and n.pool in soon:
            soon[n.pool].append([n.name, by_pool[n.pool].gpus_per_node])
    pool_of_node = {n.name: n.pool for n in nodes}
    gpu_node = {g.id: node.name for node in snapshot.nodes for g in node.gpus}
    freeing: dict[str, float] = {}
    for a in snapshot.running:
        for gid in a.gpu_ids:
            name = gpu_node.get(gid)
            pool = pool_of_node.get(name)
            if pool and a.start_time + a.job.time_limit <= now + by_pool[pool].boot_estimate_s and not a.fractions:
                freeing[name] = freeing.get(name, 0) + 1
    for name, free in sorted(freeing.items()):
        soon[pool_of_node[name]].append([name, int(free)])
    booting_names = {n.name for n in nodes if n.state == BOOTING}

    # Quotas: a job its project's or organization's limits keep waiting once the jobs before it run
    # needs no node (on an empty cluster every job passes admission alone, so the pass cannot say).
    proj_gpus: dict[str, float] = {}
    proj_jobs: dict[str, int] = {}
    org_gpus: dict[str, float] = {}
    started = {s.job_id for s in plan.starts}
    for j in [a.job for a in snapshot.running] + [queued[s] for s in started if s in queued]:
        proj_gpus[j.project] = proj_gpus.get(j.project, 0.0) + j.gpus
        proj_jobs[j.project] = proj_jobs.get(j.project, 0) + 1
        org_gpus[j.org] = org_gpus.get(j.org, 0.0) + j.gpus

    def within_quota(job) -> bool:
        q = snapshot.projects.get(job.project)
        o = snapshot.orgs.get(job.org)
        if q is not None and (proj_gpus.get(job.project, 0.0) + job.gpus > q.max_gpus + 1e-9 or (
                q.max_running_jobs is not None and proj_jobs.get(job.project, 0) + 1 > q.max_running_jobs)):
            return False
        if o is not None and o.max_gpus is not None and org_gpus.get(job.org, 0.0) + job.gpus > o.max_gpus + 1e-9:
            return False
        proj_gpus[job.project] = proj_gpus.get(job.project, 0.0) + job.gpus
        proj_jobs[job.project] = proj_jobs.get(job.project, 0) + 1
        org_gpus[job.org] = org_gpus.get(job.org, 0.0) + job.gpus
        return True

    new_bins: dict[str, list[list]] = {p.name: [] for p in pools}
    new_jobs: dict[str, dict[int, list[str]]] = {p.name: {} for p in pools}
    budget_left = dict(budgets)
    for _, jid in waiting:
        job = queued[jid]
        fits = sorted((p for p in pools if pool_fits(job, p)), key=lambda p: (p.price_per_gpu_hour, p.name))
        if not fits:
            continue
        r = reserved_at.get(jid)
        usable = [p for p in fits if p.available]
        if r is not None and r <= now + min(p.boot_estimate_s for p in fits):
            continue  # the backfill plan starts it on an existing node before a new one could boot
        if not within_quota(job):
            continue  # it waits for its quota, not for a node
        if not usable:
            out.notes[jid] = fits[0].unavailable_note or f"pool {fits[0].name} is unavailable"
            continue
        pool = usable[0]
        out.demand_gpus[pool.name] = out.demand_gpus.get(pool.name, 0.0) + job.gpus
        parts = _parts(job)
        bins = soon[pool.name]
        before = [b[1] for b in bins]
        if _fit(parts, bins):
            for b, was in zip(bins, before):
                if b[1] != was and b[0] in booting_names:
                    out.on_booting.setdefault(b[0], []).append(jid)
            continue
        # A new node is paid by the hour: its project must have budget for the job's first hour.
        need_h = job.gpus * min(job.time_limit, 3600.0) / 3600.0
        left = budget_left.get(job.project)
        if left is not None and left < need_h - 1e-9:
            out.notes[jid] = (f"pool {pool.name} adds no node for it: project {job.project} has "
                              f"{max(left, 0):.1f} GPU-hours of budget left this month")
            continue
        if left is not None:
            budget_left[job.project] = left - need_h
        nb = new_bins[pool.name]
        before = [b[1] for b in nb]
        if not _fit(parts, nb):
            start = len(nb)
            nb.extend([[f"+{start + k}", pool.gpus_per_node] for k in range(len(parts))])
            _fit(parts, nb, start)
            before += [pool.gpus_per_node] * len(parts)
        for i, (b, was) in enumerate(zip(nb, before)):
            if b[1] != was:
                new_jobs[pool.name].setdefault(i, []).append(jid)

    for p in pools:
        wanted = len(new_bins[p.name])
        n = wanted
        limited = ""
        if live[p.name] + n < p.min_nodes and p.available:
            n = p.min_nodes - live[p.name]
        caps = [(p.max_nodes - live[p.name], f"pool {p.name} is at its maximum of {p.max_nodes} nodes"),
                (p.max_per_step, f"pool {p.name} adds at most {p.max_per_step} nodes at a time")]
        if p.max_cost_per_hour is not None and p.price_per_gpu_hour > 0:
            per_node = p.price_per_gpu_hour * p.gpus_per_node
            caps.append((int(math.floor(p.max_cost_per_hour / per_node + 1e-9)) - live[p.name],
                         f"pool {p.name} would cost more than its cap of {p.max_cost_per_hour:g} an hour"))
        if not p.available:
            caps.append((0, p.unavailable_note or f"pool {p.name} is unavailable"))
        for cap, why in caps:
            if n > max(cap, 0):
                n, limited = max(cap, 0), why
        jobs = [new_jobs[p.name].get(i, []) for i in range(n)]
        if n or wanted:
            out.up[p.name] = PoolUp(pool=p.name, nodes=n, jobs=jobs, wanted=wanted, limited_by=limited)
        for i in range(n, wanted):
            for jid in new_jobs[p.name].get(i, []):
                if not any(jid in js for js in jobs):
                    out.notes[jid] = f"scaling up pool {p.name}: no node added, {limited}"

    # Scale-down: idle ready nodes, longest idle first, within the pool's limits.
    for p in pools:
        if out.demand_gpus.get(p.name):
            continue  # jobs it could serve still wait: keep what it has
        idle = sorted((n for n in nodes if n.pool == p.name and n.state == READY and n.idle_since is not None
                       and now - n.idle_since >= p.idle_release_s), key=lambda n: (n.idle_since, n.name))
        room = min(live[p.name] - p.min_nodes, p.max_concurrent_releases - releasing[p.name])
        out.release += [n.name for n in idle[:max(room, 0)]]
        room -= len(idle[:max(room, 0)])
        if room > 0 and movable:
            out.consolidate.update(_consolidate(snapshot, p, nodes, set(out.release), movable, now, room))
    return out


def _consolidate(snapshot: Snapshot, pool: PoolSpec, nodes: list[PoolNode], releasing: set[str],
                 movable, now: float, room: int) -> dict[str, list[str]]:
    """Lightly used ready nodes (at most half their GPUs busy, no job started there for the pool's
    idle time) whose every job may move and fits, whole, on the free GPUs of the pool's other
    ready nodes: those jobs are moved (they resume from their checkpoints) and the node is released
    once empty. Least used first, at most `room` nodes."""
    mine = {n.name for n in nodes if n.pool == pool.name and n.state == READY and n.name not in releasing}
    core_nodes = {n.name: n for n in snapshot.nodes if n.name in mine}
    gpu_node = {g.id: n.name for n in core_nodes.values() for g in n.gpus}
    jobs_on: dict[str, list] = {name: [] for name in core_nodes}
    used: dict[str, float] = {name: 0.0 for name in core_nodes}
    last_start: dict[str, float] = {}
    for a in snapshot.running:
        names = {gpu_node.get(g) for g in a.gpu_ids} - {None}
        for name in names:
            jobs_on[name].append(a)
            used[name] += sum(1 for g in a.gpu_ids if gpu_node.get(g) == name)
            last_start[name] = max(last_start.get(name, a.start_time), a.start_time)
    free = {name: sum(1 for g in n.gpus if g.healthy) - used[name] for name, n in core_nodes.items()
            if n.schedulable}
    out: dict[str, list[str]] = {}
    candidates = sorted((name for name in core_nodes if jobs_on[name]), key=lambda n: (used[n], n))
    for name in candidates:
        if len(out) >= room:
            break
        allocs = jobs_on[name]
        if used[name] > pool.gpus_per_node / 2 or now - last_start.get(name, now) < pool.idle_release_s:
            continue
        if any(a.job.id not in movable or a.job.nodes > 1 or a.fractions for a in allocs):
            continue
        bins = [[other, f] for other, f in sorted(free.items(), key=lambda kv: (kv[1], kv[0]))
                if other != name and other not in out and f > 0]
        if all(_fit([len(a.gpu_ids)], bins) for a in sorted(allocs, key=lambda a: -len(a.gpu_ids))):
            out[name] = sorted(a.job.id for a in allocs)
            for other, f in bins:
                free[other] = f
            free.pop(name, None)
    return out
