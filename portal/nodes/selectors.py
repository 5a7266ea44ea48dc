"""Reads for the nodes page (staff only) and the cluster view (everyone, counts only)."""
from collections import defaultdict

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from .models import GPU, GPUHealth, GPUMode, Node, NodeState


def nodes_overview() -> list[Node]:
    """Every node with its GPUs; each GPU carries `holders` (the open allocations on it, with
    their jobs) and `sample` (its latest sample from the cache, if any); each node carries
    `heartbeat_age_s`. Three queries and one cache read, whatever the fleet size."""
    from portal.jobs.models import Allocation

    nodes = list(Node.objects.prefetch_related("gpus").order_by("name"))
    holders = defaultdict(list)
    for alloc in (Allocation.objects.filter(released_at__isnull=True)
                  .select_related("job__project", "job__user").order_by("job_id")):
        holders[alloc.gpu_id].append(alloc)
    gpus = [g for n in nodes for g in n.gpus.all()]
    samples = cache.get_many([f"gpu-sample:{g.uuid}" for g in gpus]) if gpus else {}
    now = timezone.now()
    for node in nodes:
        node.heartbeat_age_s = None if node.last_heartbeat_at is None else \
            max(0, int((now - node.last_heartbeat_at).total_seconds()))
        # Past the interval twice over: worth a look before the reaper marks it down.
        node.silent = node.heartbeat_age_s is not None and node.heartbeat_age_s > 2 * settings.NODE_HEARTBEAT_INTERVAL_S
        for gpu in node.gpus.all():
            gpu.holders = holders.get(gpu.pk, [])
            gpu.sample = samples.get(f"gpu-sample:{gpu.uuid}")
    return nodes


def cluster_summary() -> dict:
    """What any signed-in user may know about the cluster (like Slurm's `sinfo`): GPUs by pool
    and model, how many are used, free and unavailable, and nodes by state. Counts only: no
    job, project or user of any tenant appears. Three queries whatever the fleet size.

    A GPU is `used` while it holds an open allocation (a shared GPU counts its fractions), `free`
    when it is healthy and idle on a node that takes jobs, and `unavailable` otherwise (its node
    is draining, drained, down or not yet verified, or the GPU is unhealthy).
    """
    from django.db.models import Count, Sum

    from portal.core.numbers import count_or_fraction
    from portal.jobs.models import ACTIVE, Allocation, Job, JobState

    taken = dict(Allocation.objects.filter(released_at__isnull=True).values("gpu_id").annotate(
        f=Sum("fraction")).values_list("gpu_id", "f").order_by())
    rows: dict[tuple[str, str], dict] = {}
    nodes_seen: dict[tuple[str, str], dict[str, set]] = {}
    for gpu in GPU.objects.select_related("node").order_by():
        node = gpu.node
        row = rows.setdefault((node.pool, gpu.model), {
            "pool": node.pool, "gpu_type": gpu.model, "memory_mb": gpu.memory_mb, "nodes": 0,
            "node_states": {}, "total": 0, "used": 0.0, "free": 0, "unavailable": 0, "shared": 0})
        states = nodes_seen.setdefault((node.pool, gpu.model), {})
        state = node.state if node.schedulable or node.state != NodeState.READY else "unverified"
        states.setdefault(state, set()).add(node.pk)
        row["total"] += 1
        row["shared"] += gpu.mode == GPUMode.SHARED
        used = float(taken.get(gpu.pk, 0))
        if used:
            row["used"] += used
        elif node.schedulable and gpu.health == GPUHealth.HEALTHY:
            row["free"] += 1
        else:
            row["unavailable"] += 1
    for key, row in rows.items():
        row["node_states"] = {s: len(ids) for s, ids in sorted(nodes_seen[key].items())}
        row["nodes"] = sum(row["node_states"].values())
        row["used"] = count_or_fraction(round(row["used"], 3))
    pools = sorted(rows.values(), key=lambda r: (r["pool"], r["gpu_type"]))
    by_type: dict[str, dict] = {}
    for row in pools:
        t = by_type.setdefault(row["gpu_type"], {"gpu_type": row["gpu_type"], "total": 0, "used": 0.0, "free": 0,
                                                 "unavailable": 0})
        for k in ("total", "used", "free", "unavailable"):
            t[k] += row[k]
        t["used"] = count_or_fraction(round(t["used"], 3))
    node_states = dict(Node.objects.values_list("state").annotate(n=Count("id")).order_by())
    queue = Job.objects.filter(state=JobState.QUEUED, is_array_parent=False).aggregate(n=Count("id"), g=Sum("gpus"))
    running = Job.objects.filter(state__in=ACTIVE - {JobState.QUEUED, JobState.PREEMPTED},
                                 is_array_parent=False).count()
    return {
        "pools": pools,
        "gpu_types": sorted(by_type.values(), key=lambda r: r["gpu_type"]),
        "nodes": {s: node_states.get(s, 0) for s in NodeState.values},
        "jobs": {"queued": queue["n"], "queued_gpus": count_or_fraction(queue["g"] or 0), "running": running},
    }
