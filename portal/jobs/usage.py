"""Running usage totals: what budgets and fair share read instead of the month's allocations.

A pass and a submit read the GPU-seconds each project used this month and its decayed fair-share
usage. Scanning every allocation of the month made both grow with history (about 9 µs a row).
Instead, each released allocation is added once to two small tables, and readers add only the
rows not in them yet (see selectors.gpu_hours_used_this_month and selectors.decayed_usage):

- ProjectMonthUsage: GPU-seconds per (project, UTC month); an allocation across a month's end
  adds its part to each month.
- ProjectFairshare: per project, sum(gpu_s * 0.5 ** ((as_of - end) / half_life)) as of `as_of`,
  so the usage at `now` is that times 0.5 ** ((now - as_of) / half_life). Adding in any order is
  exact: a later end moves `as_of` forward, an earlier one is weighted down to it.

`usage_fold()` adds the released allocations not tallied yet and marks them tallied, in one
transaction, under row locks: an allocation is added exactly once, whoever folds, however
often, and a rollback undoes both. A scheduling pass folds first, at most every 5 s
(USAGE_FOLD_INTERVAL_S in scheduler/adapter.py). Readers count untallied rows (open allocations,
and those released since the last fold) from the rows themselves, so they are exact whether or
not a fold has run.
"""
from collections import defaultdict
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction

from .models import Allocation, ProjectFairshare, ProjectMonthUsage
from .selectors import decay, month_start, next_month


def month_parts(started: datetime, released: datetime, fraction: float):
    """(month's first instant, GPU-seconds) for each UTC month that [started, released) touches."""
    month = month_start(started)
    while month < released:
        following = next_month(month)
        seconds = (min(released, following) - max(started, month)).total_seconds()
        if seconds > 0:
            yield month, seconds * fraction
        month = following


def usage_fold(*, batch: int = 5000) -> int:
    """Add every released, untallied allocation to the totals and mark it tallied; returns how many.

    In one transaction: the allocations are locked (a concurrent fold waits, then finds them
    tallied), their GPU-seconds added, the flag set. A change of SCHEDULER_FAIRSHARE_HALF_LIFE_S
    rebuilds the fair-share rows from the tallied allocations first (once).
    """
    half_life = float(settings.SCHEDULER_FAIRSHARE_HALF_LIFE_S)
    folded = 0
    with transaction.atomic():
        if ProjectFairshare.objects.exclude(half_life_s=half_life).exists():
            ProjectFairshare.objects.all().delete()
            tallied = Allocation.objects.filter(tallied=True).values_list(
                "job__project_id", "started_at", "released_at", "fraction")
            _add_fairshare(tallied.iterator(chunk_size=5000), half_life)
        while True:
            rows = list(Allocation.objects.select_for_update(of=("self",)).filter(
                tallied=False, released_at__isnull=False).order_by("pk").values_list(
                "pk", "job__project_id", "started_at", "released_at", "fraction")[:batch])
            if not rows:
                return folded
            Allocation.objects.filter(pk__in=[r[0] for r in rows]).update(tallied=True)
            _add_months([r[1:] for r in rows])
            _add_fairshare([r[1:] for r in rows], half_life)
            folded += len(rows)


def _add_months(rows) -> None:
    months: dict[tuple[int, datetime], float] = defaultdict(float)
    for project_id, started, released, fraction in rows:
        for month, gpu_s in month_parts(started, released, float(fraction)):
            months[(project_id, month)] += gpu_s
    table = ProjectMonthUsage._meta.db_table
    with connection.cursor() as cursor:
        # Adds to the month's row (PostgreSQL and SQLite both have this upsert).
        cursor.executemany(
            f"INSERT INTO {table} (project_id, month, gpu_s) VALUES (%s, %s, %s) "
            f"ON CONFLICT (project_id, month) DO UPDATE SET gpu_s = {table}.gpu_s + excluded.gpu_s",
            [(project_id, month.date(), gpu_s) for (project_id, month), gpu_s in sorted(months.items())])


def _add_fairshare(rows, half_life: float) -> None:
    ends: dict[int, list[tuple[datetime, float]]] = defaultdict(list)
    for project_id, started, released, fraction in rows:
        ends[project_id].append((released, max(0.0, (released - started).total_seconds()) * float(fraction)))
    existing = {f.project_id: f for f in ProjectFairshare.objects.select_for_update().filter(
        project_id__in=list(ends)).order_by("project_id")}
    new = []
    for project_id, items in ends.items():
        row = existing.get(project_id)
        if row is None:
            row = ProjectFairshare(project_id=project_id, half_life_s=half_life, decayed_gpu_s=0.0,
                                   as_of=items[0][0])
            new.append(row)
        for end, gpu_s in items:
            if end >= row.as_of:
                row.decayed_gpu_s = decay(row.decayed_gpu_s, (end - row.as_of).total_seconds(), half_life) + gpu_s
                row.as_of = end
            else:
                row.decayed_gpu_s += decay(gpu_s, (row.as_of - end).total_seconds(), half_life)
    ProjectFairshare.objects.bulk_create(new)
    ProjectFairshare.objects.bulk_update(list(existing.values()), ["decayed_gpu_s", "as_of"])
