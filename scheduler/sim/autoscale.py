"""Trace replay on a pool that scales: the production scheduler core places jobs, the production
autoscaler (`scheduler.core.autoscale`) adds nodes (which take jobs `boot_s` later) and releases
nodes idle for the pool's idle time, on a virtual clock.

Events: submissions, job ends, boots done, and ticks every `tick_s` while anything waits or boots
(a scheduling pass, as production's periodic one, and the autoscaler) (when nothing does, the next tick is the next idle node's release time, so a quiet
week costs no ticks). Every job runs alone from its start for its trace runtime (no preemption:
`Config(preemption=False)`), one node unless it is larger than a node (then a gang, as in
`engine.nodes_for`). Reported: GPU-hours paid (each node's GPUs from its creation to its
release, the boot included) and used (the jobs' GPUs x runtime), JCT and wait, the peak size,
and the same trace on a fixed cluster of the pool's maximum for comparison.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from scheduler.core import GPU, Allocation, Config, Job, Node, Snapshot, schedule
from scheduler.core.autoscale import BOOTING, READY, PoolNode, PoolSpec, autoscale

from .metrics import percentile
from .trace import TraceJob


@dataclass
class _Node:
    name: str
    created: float
    ready_at: float
    gpus: int
    state: str = BOOTING
    released: float | None = None
    busy: set = field(default_factory=set)  # job ids
    idle_since: float | None = None


def _core_job(t: TraceJob, per_node: int) -> Job:
    nodes = 1 if t.gpus <= per_node else math.ceil(t.gpus / per_node)
    limit = t.walltime if math.isfinite(t.walltime) else max(t.duration, 1.0) * 2
    return Job(t.id, t.tenant, t.tenant, t.tenant, t.gpus, t.submit, limit, nodes=nodes, sandbox="docker")


def replay(jobs: list[TraceJob], pool: PoolSpec, *, boot_s: float = 120.0, tick_s: float = 30.0,
           fixed: bool = False, config: Config | None = None) -> dict:
    """Replay `jobs` on `pool` (autoscaled, or `fixed` at max_nodes from the start, never released)."""
    # explain on, as in production: the autoscaler reads each waiting job's reason.
    cfg = config or Config(preemption=False, explain=True)
    per = pool.gpus_per_node
    jobs = sorted((t for t in jobs if (t.gpus <= per or t.gpus % math.ceil(t.gpus / per) == 0) and t.gpus >= 1
                   and math.ceil(t.gpus / per) <= pool.max_nodes), key=lambda t: (t.submit, t.id))
    skipped = 0
    nodes: dict[str, _Node] = {}
    seq = 0
    events: list[tuple[float, int, str, str]] = []  # (time, order, kind, what)
    order = 0

    def push(t, kind, what=""):
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, what))

    def add_node(now, ready_at):
        nonlocal seq
        seq += 1
        name = f"{pool.name}-{seq}"
        nodes[name] = _Node(name, now, ready_at, per)
        push(ready_at, "boot", name)
        return name

    t0 = jobs[0].submit if jobs else 0.0
    if fixed:
        for _ in range(pool.max_nodes):
            add_node(t0, t0)
    for t in jobs:
        push(t.submit, "submit", t.id)
    trace = {t.id: t for t in jobs}
    queue: dict[str, Job] = {}
    running: dict[str, Allocation] = {}
    job_nodes: dict[str, list[str]] = {}
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    next_tick = math.inf
    peak = 0
    ticks = 0
    stuck = 0
    used_gpu_s = 0.0

    def snapshot(now):
        core_nodes = []
        for n in nodes.values():
            if n.released is not None:
                continue
            core_nodes.append(Node(n.name, pool.name, [GPU(f"{n.name}/{i}", n.name, i, pool.gpu_model,
                                                           pool.gpu_memory_mb) for i in range(n.gpus)],
                                   schedulable=n.state == READY))
        return Snapshot(now, core_nodes, list(running.values()), list(queue.values()), {}, {}, {}, cfg)

    def schedule_tick(now):
        nonlocal next_tick
        if queue or any(n.state == BOOTING for n in nodes.values() if n.released is None):
            t = now + tick_s
        elif fixed:  # nothing to release: the next pass comes with the next event
            next_tick = math.inf
            return
        else:
            idle = [n.idle_since + pool.idle_release_s for n in nodes.values()
                    if n.released is None and n.state == READY and n.idle_since is not None]
            if not idle:
                next_tick = math.inf
                return
            t = max(now + tick_s, tick_s * math.ceil(min(idle) / tick_s))
        if t < next_tick or next_tick <= now:
            next_tick = t
            push(t, "tick")

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "submit":
            queue[what] = _core_job(trace[what], per)
        elif kind == "end":
            a = running.pop(what)
            end[what] = now
            for name in job_nodes.pop(what):
                n = nodes[name]
                n.busy.discard(what)
                if not n.busy:
                    n.idle_since = now
        elif kind == "boot":
            n = nodes.get(what)
            if n is None or n.released is not None:
                continue
            n.state, n.idle_since = READY, now
        elif kind == "tick":
            if now != next_tick:
                continue  # superseded
            next_tick = math.inf
            ticks += 1
        # A pass at every event, as production runs one on submit, end and node change.
        snap = snapshot(now)
        plan = schedule(snap)
        for s in plan.starts:
            job = queue.pop(s.job_id)
            names = sorted({g.split("/")[0] for g in s.gpu_ids})
            running[job.id] = Allocation(job, s.gpu_ids, now)
            job_nodes[job.id] = names
            for name in names:
                nodes[name].busy.add(job.id)
                nodes[name].idle_since = None
            start[job.id] = now
            used_gpu_s += job.gpus * trace[job.id].runtime
            push(now + trace[job.id].runtime, "end", job.id)
        if kind == "tick" and not fixed:
            snap = snapshot(now)
            live = [PoolNode(n.name, pool.name, n.state, n.created, n.idle_since if not n.busy else None)
                    for n in nodes.values() if n.released is None]
            out = autoscale(snap, plan if not plan.starts else schedule(snap), [pool], live, None, now)
            up = out.up.get(pool.name)
            for _ in range(up.nodes if up else 0):
                add_node(now, now + boot_s)
            live_now = [n for n in nodes.values() if n.released is None]
            stuck = stuck + 1 if queue and not running and not live_now else 0
            if stuck > 10:  # nothing runs, nothing boots, nothing is added: the rest can never start
                break
            for name in out.release:
                nodes[name].released = now
        peak = max(peak, sum(1 for n in nodes.values() if n.released is None))
        schedule_tick(now)
        if not events and not queue and not running:
            break
    t_end = max([*end.values(), *(n.released or 0.0 for n in nodes.values())], default=t0)
    for n in nodes.values():
        if n.released is None:
            n.released = t_end
    paid = sum(n.gpus * (n.released - n.created) for n in nodes.values())
    jct = [end[j] - trace[j].submit for j in end]
    wait = [start[j] - trace[j].submit for j in end]
    return {
        "mode": "fixed" if fixed else "autoscale", "jobs": len(end), "skipped": skipped + len(queue),
        "gpu_hours_paid": paid / 3600, "gpu_hours_used": used_gpu_s / 3600,
        "used_of_paid": used_gpu_s / paid if paid else 0.0,
        "jct_mean_h": sum(jct) / len(jct) / 3600 if jct else None,
        "jct_p95_h": percentile(jct, 95) / 3600 if jct else None,
        "wait_mean_h": sum(wait) / len(wait) / 3600 if wait else None,
        "nodes_peak": peak, "nodes_created": len(nodes), "ticks": ticks,
        "cost": paid / 3600 * pool.price_per_gpu_hour,
    }


def compare(jobs: list[TraceJob], pool: PoolSpec, *, boot_s: float, tick_s: float,
            idle_times: list[float]) -> list[dict]:
    """The fixed cluster of max_nodes, then autoscaling at each idle time."""
    rows = [replay(jobs, pool, boot_s=boot_s, tick_s=tick_s, fixed=True)]
    for idle in idle_times:
        row = replay(jobs, replace(pool, idle_release_s=idle), boot_s=boot_s, tick_s=tick_s)
        row["idle_release_s"] = idle
        rows.append(row)
    return rows
