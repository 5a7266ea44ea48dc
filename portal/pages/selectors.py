"""Reads that put two apps' data together for a page."""
from portal.jobs.selectors import gpu_hours_used_this_month, gpus_in_use


def usage_level(used, limit) -> str:
    """'ok', 'warn' from 50 % of the limit, 'danger' from 80 %: the colours of the quota bars."""
    if not limit:
        return "danger" if used else "ok"
    ratio = float(used) / float(limit)
    return "danger" if ratio >= 0.8 else "warn" if ratio >= 0.5 else "ok"


def _bar(used, limit) -> dict:
    percent = 0 if not limit else min(100, round(float(used) * 100 / float(limit)))
    return {"used": used, "limit": limit, "percent": percent, "level": usage_level(used, limit)}


def quota_usage(projects) -> list[dict]:
    """Per project: GPUs held now of guaranteed/max (open allocations) and GPU-hours this month
    of the budget, each with a percentage and a level for the bar."""
    projects = list(projects)
    ids = [p.pk for p in projects]
    in_use = gpus_in_use(ids)
    hours = gpu_hours_used_this_month(ids)
    out = []
    for p in projects:
        quota = p.quota
        gpus = in_use.get(p.pk, 0)
        used_hours = round(hours.get(p.pk, 0.0), 1)
        out.append({
            "project": p,
            "gpus": {**_bar(gpus, quota.max_gpus), "guaranteed": quota.guaranteed_gpus,
                     "guaranteed_percent": 0 if not quota.max_gpus else
                     min(100, round(float(quota.guaranteed_gpus) * 100 / float(quota.max_gpus)))},
            "hours": _bar(used_hours, quota.gpu_hours_budget) if quota.gpu_hours_budget is not None else None,
        })
    return out
