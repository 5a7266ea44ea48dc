"""Reads for jobs: usage figures the scheduler and submit checks need, list filters."""
from collections import defaultdict
from datetime import datetime, timezone as dt_timezone

from django.db.models import Q
from django.utils import timezone

from .models import Allocation


def month_start(now: datetime | None = None) -> datetime:
    now = now or timezone.now()
    return now.astimezone(dt_timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def gpu_hours_used_this_month(project_ids, now: datetime | None = None) -> dict[int, float]:
    """GPU-hours each project's allocations covered since the start of the month (open ones up to now)."""
    now = now or timezone.now()
    start = month_start(now)
    used: dict[int, float] = defaultdict(float)
    rows = Allocation.objects.filter(job__project_id__in=list(project_ids)).filter(
        Q(released_at__isnull=True) | Q(released_at__gt=start)
    ).values_list("job__project_id", "started_at", "released_at", "fraction")
    for project_id, started, released, fraction in rows:
        seconds = ((released or now) - max(started, start)).total_seconds()
        used[project_id] += max(0.0, seconds) * float(fraction) / 3600
    return dict(used)


def decayed_usage(project_ids, *, half_life_s: float, now: datetime | None = None, horizon_half_lives: int = 6):
    """GPU-seconds per project, each allocation weighted by 0.5 ** (age / half_life).

    Age is measured to the allocation's end (now for open ones); allocations older than
    `horizon_half_lives` half-lives weigh under 2% and are skipped.
    """
    from datetime import timedelta

    now = now or timezone.now()
    horizon = now - timedelta(seconds=half_life_s * horizon_half_lives)
    usage: dict[int, float] = defaultdict(float)
    rows = Allocation.objects.filter(job__project_id__in=list(project_ids)).filter(
        Q(released_at__isnull=True) | Q(released_at__gt=horizon)
    ).values_list("job__project_id", "started_at", "released_at", "fraction")
    for project_id, started, released, fraction in rows:
        end = released or now
        seconds = max(0.0, (end - started).total_seconds()) * float(fraction)
        age = (now - end).total_seconds()
        usage[project_id] += seconds * 0.5 ** (age / half_life_s)
    return dict(usage)


def launch_spec(job_id: int, node_name: str) -> dict | None:
    """What the agent on `node_name` needs to start its part of the job, or None if the job
    no longer holds GPUs there. Multi-node gangs get the rendezvous variables torchrun uses."""
    from .models import HOLDING, Job

    job = Job.objects.filter(pk=job_id, state__in=HOLDING).select_related("project__quota", "node").first()
    if job is None:
        return None
    allocs = list(Allocation.objects.filter(job=job, released_at__isnull=True).select_related("gpu__node")
                  .order_by("gpu__node__name", "gpu__index"))
    nodes = list(dict.fromkeys(a.gpu.node.name for a in allocs)) or [job.node.name if job.node else node_name]
    if node_name not in nodes:
        return None
    mine = [a for a in allocs if a.gpu.node.name == node_name]
    rendezvous = None
    if len(nodes) > 1:
        # The master is the first node; the port is derived from the job id so gangs do not collide.
        rendezvous = {"MASTER_ADDR": nodes[0], "MASTER_PORT": str(29500 + job.pk % 1000),
                      "WORLD_SIZE": str(len(allocs)), "NODE_RANK": str(nodes.index(node_name)),
                      "LOCAL_WORLD_SIZE": str(len(mine))}
    fraction = float(mine[0].fraction) if mine and mine[0].shared else None
    return {
        "job_id": str(job.pk), "attempt": job.attempt, "image": job.image, "command": job.command, "env": job.env,
        "gpu_indexes": [a.gpu.index for a in mine], "gpu_uuids": [a.gpu.uuid for a in mine],
        "cpus": float(job.cpus), "memory_mb": job.memory_mb, "time_limit_s": job.time_limit_s,
        "network": bool(job.network and job.project.quota.network_allowed), "sandbox": job.sandbox,
        "array_index": job.array_index, "gpu_fraction": fraction,
        "gpu_memory_mb": job.gpu_memory_mb or None, "rendezvous": rendezvous,
    }
