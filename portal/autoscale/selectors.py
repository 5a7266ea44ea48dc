"""Reads for the console's autoscaling page: pool sizes, waiting demand, GPU-hours paid and used, events."""
from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from portal.jobs.models import Allocation, Job, JobState
from scheduler.core import Job as CoreJob
from scheduler.core import Reason
from scheduler.core.autoscale import pool_fits, wants_capacity

from .models import NodePool, PoolNode, PoolNodeState, ScaleEvent
from .services import pool_specs


def _overlap_s(start, end, lo, hi) -> float:
    if lo is not None:
        start = max(start, lo)
    end = min(end, hi)
    return max((end - start).total_seconds(), 0.0)


def gpu_hours(*, since=None, now=None) -> dict[str, dict[str, float]]:
    """Per pool: GPU-hours paid (each node's GPUs from its creation to its release) and used (the
    allocations on its GPUs), and what was paid, over [since, now] (all time when since is None)."""
    now = now or timezone.now()
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"paid": 0.0, "used": 0.0, "cost": 0.0})
    nodes = PoolNode.objects.filter(Q(released_at__isnull=True) | Q(released_at__gt=since) if since else Q())
    node_pool = {}
    for name, pool, node_id, gpus, price, created, released in nodes.values_list(
            "name", "pool__name", "node_id", "gpus", "price_per_gpu_hour", "created_at", "released_at"):
        hours = gpus * _overlap_s(created, released or now, since, now) / 3600
        out[pool]["paid"] += hours
        out[pool]["cost"] += hours * float(price)
        if node_id:
            node_pool[node_id] = pool
    allocs = Allocation.objects.filter(gpu__node_id__in=list(node_pool))
    if since:
        allocs = allocs.filter(Q(released_at__isnull=True) | Q(released_at__gt=since))
    for node_id, fraction, started, released in allocs.values_list("gpu__node_id", "fraction", "started_at",
                                                                   "released_at"):
        out[node_pool[node_id]]["used"] += float(fraction) * _overlap_s(started, released or now, since, now) / 3600
    return dict(out)


def waiting_demand() -> dict[str, dict[str, float]]:
    """Per pool: the queued jobs waiting for capacity that the pool's shape can hold (each counted
    in its cheapest such pool), as jobs and GPUs."""
    now = timezone.now()
    specs = sorted(pool_specs(NodePool.objects.filter(enabled=True), now),
                   key=lambda s: (s.price_per_gpu_hour, s.name))
    out = {s.name: {"jobs": 0, "gpus": 0.0} for s in specs}
    if not specs:
        return out
    for jid, gpus, nodes, gpu_type, mem, sandbox, code, msg in Job.objects.filter(
            state=JobState.QUEUED, held=False, is_array_parent=False, gpus__gte=1).values_list(
            "id", "gpus", "nodes", "gpu_type", "gpu_memory_mb", "sandbox", "reason_code", "reason_message"):
        if not wants_capacity(Reason(code, msg, 0)) and not msg.startswith("scaling up"):
            continue
        job = CoreJob(str(jid), "", "", "", float(gpus), 0.0, 0.0, gpu_type=gpu_type or None, gpu_memory_mb=mem,
                      sandbox=sandbox, nodes=nodes)
        for s in specs:
            if pool_fits(job, s):
                out[s.name]["jobs"] += 1
                out[s.name]["gpus"] += float(gpus)
                break
    return out


def pool_summaries(now=None) -> list[dict]:
    now = now or timezone.now()
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for pool, state in PoolNode.objects.filter(state__in=[PoolNodeState.BOOTING, PoolNodeState.READY,
                                                          PoolNodeState.RELEASING]).values_list("pool__name", "state"):
        counts[pool][state] += 1
    day = gpu_hours(since=now - timedelta(days=1), now=now)
    total = gpu_hours(now=now)
    demand = waiting_demand()
    out = []
    for p in NodePool.objects.all():
        c = counts[p.name]
        d, t = day.get(p.name, {}), total.get(p.name, {})
        out.append({
            "pool": p, "name": p.name, "booting": c["booting"], "ready": c["ready"], "releasing": c["releasing"],
            "live": c["booting"] + c["ready"], "demand_jobs": demand.get(p.name, {}).get("jobs", 0),
            "demand_gpus": demand.get(p.name, {}).get("gpus", 0.0),
            "gpu_hours_paid_24h": d.get("paid", 0.0), "gpu_hours_used_24h": d.get("used", 0.0),
            "cost_24h": d.get("cost", 0.0),
            "gpu_hours_paid": t.get("paid", 0.0), "gpu_hours_used": t.get("used", 0.0), "cost": t.get("cost", 0.0),
            "unavailable": p.unavailable_until is not None and p.unavailable_until > now,
        })
    return out


def size_series(*, since, now=None, step_s: int = 300) -> dict:
    """Live nodes per pool at each step in [since, now]: from the nodes' creation and release times."""
    now = now or timezone.now()
    rows = list(PoolNode.objects.filter(Q(released_at__isnull=True) | Q(released_at__gt=since),
                                        created_at__lte=now).values_list("pool__name", "created_at", "released_at"))
    pools = sorted({r[0] for r in rows})
    times = []
    t = since
    while t <= now:
        times.append(t)
        t += timedelta(seconds=step_s)
    series = {p: [sum(1 for pool, c, r in rows if pool == p and c <= at and (r is None or r > at)) for at in times]
              for p in pools}
    return {"t": [int(x.timestamp()) for x in times], "pools": series, "times": times}


def recent_events(limit: int = 100):
    return ScaleEvent.objects.select_related("pool")[:limit]
