"""Reads for billing: usage reports (JSON and CSV share them), per-job accounting, budget status."""
from collections import defaultdict
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

from django.conf import settings
from django.db.models import Q, Sum
from django.db.models.functions import TruncDay
from django.utils import timezone

from portal.core.errors import NotFound
from portal.core.numbers import count_or_fraction
from portal.jobs.models import Allocation, Job
from portal.jobs.selectors import gpu_hours_used_this_month
from portal.metrics.models import GpuRollup, Resolution
from portal.tenancy.models import Organization, Project

from .models import UsageRecord

GROUP_BY = {
    "day": ("day", TruncDay("hour", tzinfo=dt_timezone.utc)),
    "project": ("project", "project__slug"),
    "organization": ("organization", "organization__slug"),
    "user": ("user", "user__username"),
    "gpu_model": ("gpu_model", "gpu_model"),
}


def usage_report(*, user, restricted_project_id=None, organization: str = "", project: str = "",
                 start: datetime | None = None, end: datetime | None = None, group_by: str = "day") -> dict:
    """Usage the caller may see, summed by `group_by`, with a total row.

    Scoped through UsageRecord.objects.for_user (the tenancy choke point); naming an
    organization or project the caller cannot see is a NotFound, as for any other object.
    """
    qs = UsageRecord.objects.for_user(user, "view", project_id=restricted_project_id)
    if organization:
        if not Organization.objects.for_user(user, "view", project_id=restricted_project_id).filter(
                slug=organization).exists():
            raise NotFound(f"No organization named {organization!r}.", field="organization")
        qs = qs.filter(organization__slug=organization)
    if project:
        if not Project.objects.for_user(user, "view", project_id=restricted_project_id).filter(slug=project).exists():
            raise NotFound(f"No project named {project!r}.", field="project")
        qs = qs.filter(project__slug=project)
    if start is not None:
        qs = qs.filter(hour__gte=start)
    if end is not None:
        qs = qs.filter(hour__lt=end)
    key, expr = GROUP_BY[group_by]
    if isinstance(expr, str):
        grouped = qs.values(expr).annotate(gpu_seconds=Sum("gpu_seconds"), amount=Sum("amount")).order_by(expr)
    else:
        grouped = qs.annotate(**{key: expr}).values(key).annotate(
            gpu_seconds=Sum("gpu_seconds"), amount=Sum("amount")).order_by(key)
    rows = []
    total_s = Decimal(0)
    total_a = Decimal(0)
    for r in grouped:
        value = r[expr if isinstance(expr, str) else key]
        if isinstance(value, datetime):
            value = value.date().isoformat()
        seconds, amount = r["gpu_seconds"] or Decimal(0), r["amount"] or Decimal(0)
        total_s += seconds
        total_a += amount
        rows.append({key: value, "gpu_seconds": _s(seconds), "gpu_hours": _h(seconds), "amount": _a(amount)})
    return {
        "group_by": group_by, "from": start.isoformat() if start else None, "to": end.isoformat() if end else None,
        "results": rows, "total": {"gpu_seconds": _s(total_s), "gpu_hours": _h(total_s), "amount": _a(total_a)},
    }


def _s(d: Decimal) -> str:
    return str(d.quantize(Decimal("0.001")))


def _h(d: Decimal) -> str:
    return str((d / 3600).quantize(Decimal("0.001")))


def _a(d: Decimal) -> str:
    return str(d.quantize(Decimal("0.01")))


def budget_status(*, user, restricted_project_id=None, now: datetime | None = None) -> list[dict]:
    """Each visible project with a budget: GPU-hours used this month (the figure the scheduler's
    budget stop reads), the share, and its level."""
    now = now or timezone.now()
    month = now.astimezone(dt_timezone.utc).date().replace(day=1)
    projects = list(Project.objects.for_user(user, "view", project_id=restricted_project_id)
                    .filter(quota__gpu_hours_budget__isnull=False).select_related("quota", "organization")
                    .order_by("slug"))
    used = gpu_hours_used_this_month([p.pk for p in projects], now=now)
    out = []
    for p in projects:
        budget = float(p.quota.gpu_hours_budget)
        share = used.get(p.pk, 0.0) / budget if budget > 0 else 1.0
        level = "exceeded" if share >= 1 else "warning" if share >= settings.BILLING_BUDGET_WARN_FRACTION else "ok"
        out.append({"project": p.slug, "organization": p.organization.slug, "month": f"{month:%Y-%m}",
                    # Numbers, not decimal strings, like the quota they come from.
                    "budget_gpu_hours": count_or_fraction(p.quota.gpu_hours_budget),
                    "used_gpu_hours": round(used.get(p.pk, 0.0), 3),
                    "used_ratio": round(share, 4), "level": level, "hard_stop": p.quota.budget_hard_stop})
    return out


JOB_ACCOUNTING_MAX = 500


def job_accounting(*, user, restricted_project_id=None, project: str = "", username: str = "",
                   start: datetime | None = None, end: datetime | None = None, job_ids=None,
                   limit: int = 100, now: datetime | None = None) -> dict:
    """Per-job accounting like Slurm's `sacct` and `seff`, for the jobs the caller may see that
    held GPUs (or ran CPU-only) in [start, end), newest first.

    1. Pick the jobs through Job.objects.for_user (the tenancy choke point): an attempt's
       allocation overlaps the range, or, CPU-only, it ran in it.
    2. GPU-seconds allocated: every attempt's allocations, start to release (or now), times
       their fraction: the whole job, like sacct, not only the part inside the range.
    3. GPU efficiency (seff's "used / allocated"): the mean of the GPUs' minute utilization
       rollups inside the allocations, as a share of 1; hourly rollups where minutes have been
       pruned; None without samples. A shared GPU's utilization is the whole GPU's.
    4. Cost: the job's usage records (metered hourly; a running job's latest hour follows).
    """

    now = now or timezone.now()
    jobs = Job.objects.for_user(user, "view", project_id=restricted_project_id).filter(is_array_parent=False)
    if project:
        if not Project.objects.for_user(user, "view", project_id=restricted_project_id).filter(slug=project).exists():
            raise NotFound(f"No project named {project!r}.", field="project")
        jobs = jobs.filter(project__slug=project)
    if username:
        jobs = jobs.filter(user__username=username)
    if job_ids is not None:
        jobs = jobs.filter(pk__in=job_ids)
    overlap = Q()
    if end is not None:
        overlap &= Q(allocations__started_at__lt=end)
    if start is not None:
        overlap &= Q(allocations__released_at__isnull=True) | Q(allocations__released_at__gt=start)
    cpu_only = Q(gpus=0, started_at__isnull=False)
    if end is not None:
        cpu_only &= Q(started_at__lt=end)
    if start is not None:
        cpu_only &= Q(ended_at__isnull=True) | Q(ended_at__gt=start)
    jobs = jobs.filter((Q(allocations__isnull=False) & overlap) | cpu_only).distinct()
    count = jobs.count()
    rows = list(jobs.select_related("project", "user").order_by("-submitted_at", "-id")[:limit])
    allocs = defaultdict(list)
    for a in Allocation.objects.filter(job_id__in=[j.pk for j in rows]).values(
            "job_id", "gpu_id", "gpu__model", "fraction", "started_at", "released_at"):
        allocs[a["job_id"]].append(a)
    util = _allocation_utilization([a for rows_ in allocs.values() for a in rows_], now=now,
                                   rollups=GpuRollup.objects, minute=Resolution.MINUTE, hour=Resolution.HOUR)
    cost = {job_id: (amount, currency) for job_id, amount, currency in UsageRecord.objects.filter(
        job_id__in=[j.pk for j in rows]).values("job_id", "currency").annotate(a=Sum("amount")).values_list(
        "job_id", "a", "currency").order_by()}
    results = []
    total_s = total_cost = 0.0
    for job in rows:
        mine = allocs.get(job.pk, [])
        gpu_s = sum(((a["released_at"] or now) - a["started_at"]).total_seconds() * float(a["fraction"])
                    for a in mine)
        buckets = [u for a in mine for u in util.get(id(a), [])]
        amount, currency = cost.get(job.pk, (None, ""))
        total_s += gpu_s
        total_cost += float(amount or 0)
        results.append({
            "id": job.pk, "slurm_id": job.slurm_id, "name": job.name, "project": job.project.slug,
            "user": job.user.username, "state": job.state, "exit_code": job.exit_code,
            "gpus": count_or_fraction(job.gpus),
            "gpu_types": sorted({a["gpu__model"] for a in mine}),
            "started_at": job.started_at, "ended_at": job.ended_at, "elapsed": job.elapsed_s,
            "gpu_seconds": round(gpu_s, 3), "gpu_hours": round(gpu_s / 3600, 3),
            "gpu_efficiency": round(sum(buckets) / len(buckets) / 100, 4) if buckets else None,
            "amount": None if amount is None else round(float(amount), 2), "currency": currency,
        })
    return {"from": start.isoformat() if start else None, "to": end.isoformat() if end else None, "count": count,
            "results": results,
            "total": {"gpu_seconds": round(total_s, 3), "gpu_hours": round(total_s / 3600, 3),
                      "amount": round(total_cost, 2)}}


def _allocation_utilization(allocs: list[dict], *, now, rollups, minute: int, hour: int) -> dict[int, list[float]]:
    """{id(allocation row): [utilization % of each rollup bucket inside it]}: minute buckets,
    or hourly ones where no minute bucket is kept. Two queries for all the allocations."""
    if not allocs:
        return {}
    gpu_ids = {a["gpu_id"] for a in allocs}
    lo = min(a["started_at"] for a in allocs)
    hi = max(a["released_at"] or now for a in allocs)
    out: dict[int, list[float]] = {}
    for resolution, floor in ((minute, timedelta(minutes=1)), (hour, timedelta(hours=1))):
        series = defaultdict(list)
        for gpu_id, bucket, util in rollups.filter(resolution=resolution, gpu_id__in=gpu_ids, bucket__gte=lo - floor,
                                                  bucket__lt=hi).values_list("gpu_id", "bucket", "util_avg"):
            series[gpu_id].append((bucket, util))
        for a in allocs:
            if id(a) in out:
                continue
            end = a["released_at"] or now
            # A bucket counts when it starts inside the allocation (its first partial minute too).
            found = [u for b, u in series.get(a["gpu_id"], []) if a["started_at"] - floor < b < end]
            if found:
                out[id(a)] = found
    return out
