"""Reads for billing: usage reports (JSON and CSV share them), budget status."""
from datetime import datetime, timezone as dt_timezone
from decimal import Decimal

from django.db.models import Sum
from django.db.models.functions import TruncDay
from django.utils import timezone

from portal.core.errors import NotFound

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
    from portal.tenancy.models import Organization, Project

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
    """Each visible project with a budget: GPU-hours billed this month, the share, and its level."""
    from django.conf import settings

    from portal.tenancy.models import Project

    from .services import gpu_hours_billed

    now = now or timezone.now()
    month = now.astimezone(dt_timezone.utc).date().replace(day=1)
    projects = list(Project.objects.for_user(user, "view", project_id=restricted_project_id)
                    .filter(quota__gpu_hours_budget__isnull=False).select_related("quota", "organization")
                    .order_by("slug"))
    used = gpu_hours_billed([p.pk for p in projects], month=month)
    out = []
    for p in projects:
        budget = float(p.quota.gpu_hours_budget)
        share = used.get(p.pk, 0.0) / budget if budget > 0 else 1.0
        level = "exceeded" if share >= 1 else "warning" if share >= settings.BILLING_BUDGET_WARN_FRACTION else "ok"
        out.append({"project": p.slug, "organization": p.organization.slug, "month": f"{month:%Y-%m}",
                    "budget_gpu_hours": str(p.quota.gpu_hours_budget), "used_gpu_hours": f"{used.get(p.pk, 0.0):.3f}",
                    "used_ratio": round(share, 4), "level": level, "hard_stop": p.quota.budget_hard_stop})
    return out
