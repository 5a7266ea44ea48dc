"""Reads for the nodes page (staff only) and the cluster view (everyone, counts only): the nodes'
part. What jobs hold is read above jobs and handed in (portal/console/selectors.py)."""
from django.conf import settings
from django.core.cache import cache
from django.db.models import Count
from django.utils import timezone

from portal.core.numbers import count_or_fraction

from .models import GPU, GPUHealth, GPUMode, Node, NodeState


def nodes_overview(holders: dict[int, list]) -> list[Node]:
    """Every node with its GPUs; each GPU carries `holders` (what `holders` gives for its id: the
    console hands in the open allocations on it, with their jobs) and `sample` (its latest sample
    from the cache, if any); each node carries `heartbeat_age_s`. Two queries and one cache read,
    whatever the fleet size."""
    nodes = list(Node.objects.prefetch_related("gpus").order_by("name"))
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


def cluster_gpus(taken: dict[int, float]) -> dict:
    """What any signed-in user may know about the cluster's GPUs (like Slurm's `sinfo`): by pool
    and model, how many are used, free and unavailable, and nodes by state. Counts only. `taken`:
    each GPU's id to the fraction of it open allocations hold (the console reads them). Two
    queries whatever the fleet size.

    A GPU is `used` while it holds an open allocation (a shared GPU counts its fractions), `free`
    when it is healthy and idle on a node that takes jobs, and `unavailable` otherwise (its node
    is draining, drained, down or not yet verified, or the GPU is unhealthy).
    """
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
    return {
        "pools": pools,
        "gpu_types": sorted(by_type.values(), key=lambda r: r["gpu_type"]),
        "nodes": {s: node_states.get(s, 0) for s in NodeState.values},
    }
