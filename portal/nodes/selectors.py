"""Reads for the nodes page (staff only)."""
from collections import defaultdict

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from .models import Node


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
