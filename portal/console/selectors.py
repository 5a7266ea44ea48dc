"""Reads for the admin console. Every chart reads rollups or small aggregates, never raw samples,
so the page stays fast with a thousand nodes and a week of history (bench/console_bench.py)."""
from collections import defaultdict
from datetime import timedelta, timezone as dt_timezone

from django.conf import settings
from django.db.models import Count, Max, Sum
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import mark_safe

from portal.billing.models import UsageDay
from portal.core.numbers import count_or_fraction
from portal.jobs.models import ACTIVE, Allocation, Job, JobState
from portal.metrics.models import GpuRollup, Resolution
from portal.metrics.selectors import TimeRange, fleet_range, gpu_util_range
from portal.nodes import selectors as node_selectors
from portal.nodes.models import GPU, GPUHealth


def fleet_series(*, time_range: TimeRange, now=None) -> list[dict]:
    """Fleet rows over the range (minute rows for 1 h and 24 h, hourly ones for 7 d and 30 d with
    the current hour's minutes after them: a job started a minute ago shows at once)."""
    return fleet_range(time_range=time_range, now=now)


# The heat map shows the fleet now, whatever the charts' range: a per-GPU mean over a month would
# hide the job that started a minute ago, and it costs a second with 8,000 GPUs (bench/console_bench.py).
HEAT_WINDOW = TimeRange("5m", "5 minutes", timedelta(minutes=5), Resolution.MINUTE)


def gpu_heat(*, now=None) -> dict:
    """Per-GPU mean utilization over HEAT_WINDOW: {rows: [(node, [util|None per GPU index])], columns}."""
    util = gpu_util_range(time_range=HEAT_WINDOW, now=now)
    nodes: dict[str, list] = defaultdict(list)
    for pk, node, index in GPU.objects.order_by("node__name", "index").values_list("pk", "node__name", "index"):
        nodes[node].append(util.get(pk))
    rows = list(nodes.items())
    return {"rows": rows, "columns": max((len(v) for _, v in rows), default=0)}


def heat_level(value: float) -> int:
    """The colour step (0..10) of a utilization in percent: CSS classes heat-0 .. heat-10."""
    return max(0, min(10, round(value / 10)))


def heat_table(rows) -> str:
    """The heat map as table rows, built in one pass (thousands of rows; a template loop would
    cost more than the rest of the page). Each cell carries its number and a colour step."""
    out = []
    for name, values in rows:
        cells = "".join('<td class="heat-none">–</td>' if v is None else
                        f'<td class="heat-{heat_level(v)}">{v:.0f}</td>' for v in values)
        out.append(f'<tr><th scope="row">{escape(name)}</th>{cells}</tr>')
    return mark_safe("".join(out))  # names escaped, the rest numbers


def _when(r) -> str:
    hour = " (hour)" if r["resolution"] == Resolution.HOUR else ""
    return r["bucket"].astimezone(dt_timezone.utc).strftime("%Y-%m-%d %H:%M") + hour


def fleet_tables(rows) -> tuple[str, str]:
    """The fleet and queue charts' numbers as table rows, in one pass like heat_table (24 h by the
    minute is 1,440 rows a table)."""
    fleet, queue = [], []
    for r in rows:
        when = _when(r)
        fleet.append(f'<tr><td>{when}</td><td class="num">{r["gpus"]}</td><td class="num">{r["allocated_gpus"]:.2f}'
                     f'</td><td class="num">{r["used_gpus"]:.2f}</td></tr>')
        wait = "–" if r["wait_avg_s"] is None else f"{r['wait_avg_s']:.0f}"
        queue.append(f'<tr><td>{when}</td><td class="num">{r["queued_jobs"]}</td><td class="num">{r["started_jobs"]}'
                     f'</td><td class="num">{wait}</td></tr>')
    return mark_safe("".join(fleet)), mark_safe("".join(queue))  # numbers and dates only


def idle_table(rows) -> str:
    """The idle-but-allocated rows in one pass, like heat_table (a busy fleet has thousands)."""
    out = []
    for r in rows:
        flagged = r["job__idle_since"].strftime("%Y-%m-%d %H:%M") if r["job__idle_since"] else "-"
        out.append(f"<tr><td>{escape(r['gpu__node__name'])}</td><td>{r['gpu__index']}</td><td>{r['job_id']}</td>"
                   f"<td>{escape(r['job__project__slug'])}</td><td>{r['peak']:.1f}</td><td>{flagged}</td></tr>")
    return mark_safe("".join(out))  # names escaped, the rest numbers and dates


def unhealthy_gpus() -> list[dict]:
    return list(GPU.objects.filter(health=GPUHealth.UNHEALTHY).order_by("node__name", "index")
                .values("node__name", "index", "uuid", "model", "health_reason")[:500])


def idle_allocated_gpus(*, now=None) -> list[dict]:
    """GPUs held by an allocation for the whole idle window whose utilization never rose above
    GPU_IDLE_UTIL_PCT in it (from minute rollups). job__idle_since: when the idle detector
    flagged the job (metrics.services.jobs_flag_idle), None while not (yet) flagged."""
    now = now or timezone.now()
    start = now - timedelta(minutes=settings.GPU_IDLE_MINUTES)
    held = {a["gpu_id"]: a for a in Allocation.objects.filter(released_at__isnull=True, started_at__lte=start)
            .values("gpu_id", "gpu__node__name", "gpu__index", "job_id", "job__project__slug", "started_at",
                    "job__idle_since")}
    if not held:
        return []
    peaks = (GpuRollup.objects.filter(resolution=Resolution.MINUTE, bucket__gte=start, gpu_id__in=list(held))
             .values("gpu_id").annotate(peak=Max("util_max"), n=Count("id")).order_by())
    out = []
    for p in peaks:
        if p["peak"] < settings.GPU_IDLE_UTIL_PCT:
            row = held[p["gpu_id"]]
            out.append({**row, "peak": p["peak"], "minutes": p["n"]})
    return sorted(out, key=lambda r: (r["gpu__node__name"], r["gpu__index"]))


def queue_now() -> list[dict]:
    """Queued jobs by the reason they wait, most common first."""
    return list(Job.objects.filter(state=JobState.QUEUED, is_array_parent=False).values("reason_code")
                .annotate(n=Count("id")).order_by("-n", "reason_code"))


def revenue_this_month(*, now=None) -> dict:
    """Usage and amounts of the current month by organization and by project, from the per-day
    sums metering keeps (billing.UsageDay): a page load reads ~31 rows per project, not the
    ledger's row per allocation and hour. As fresh as the last metering run (60 s)."""
    now = now or timezone.now()
    start = now.astimezone(dt_timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    month = UsageDay.objects.filter(day__gte=start.date())
    by_org = list(month.values("organization__slug").annotate(s=Sum("gpu_seconds"), a=Sum("amount"))
                  .order_by("-a", "organization__slug"))
    by_project = list(month.values("organization__slug", "project__slug").annotate(
        s=Sum("gpu_seconds"), a=Sum("amount")).order_by("-a", "project__slug"))
    by_day = list(month.values("day").annotate(a=Sum("amount"), s=Sum("gpu_seconds")).order_by("day"))
    for r in by_org + by_project + by_day:
        r["hours"] = float(r["s"] or 0) / 3600
        r["a"] = float(r["a"] or 0)
    # Amounts are summed across rate cards; cards are written in BILLING_CURRENCY (billing.services).
    last_day = (start + timedelta(days=32)).replace(day=1).date() - timedelta(days=1)
    return {"month": start, "last_day": last_day, "organizations": by_org, "projects": by_project, "days": by_day,
            "currency": settings.BILLING_CURRENCY,
            "total": sum(r["a"] for r in by_org), "hours": sum(r["hours"] for r in by_org)}


def nodes_overview() -> list:
    """The nodes page: every node with its GPUs (nodes.selectors.nodes_overview), each GPU with
    the open allocations on it and their jobs as `holders`. Three queries and one cache read,
    whatever the fleet size."""
    holders = defaultdict(list)
    for alloc in (Allocation.objects.filter(released_at__isnull=True)
                  .select_related("job__project", "job__user").order_by("job_id")):
        holders[alloc.gpu_id].append(alloc)
    return node_selectors.nodes_overview(holders)


def cluster_summary() -> dict:
    """What any signed-in user may know about the cluster (like Slurm's `sinfo`): its GPUs
    (nodes.selectors.cluster_gpus, given what open allocations hold of each) and how many jobs
    wait and run over all tenants. Counts only: no job, project or user of any tenant appears.
    Four queries whatever the fleet size."""
    taken = dict(Allocation.objects.filter(released_at__isnull=True).values("gpu_id").annotate(
        f=Sum("fraction")).values_list("gpu_id", "f").order_by())
    queue = Job.objects.filter(state=JobState.QUEUED, is_array_parent=False).aggregate(n=Count("id"), g=Sum("gpus"))
    running = Job.objects.filter(state__in=ACTIVE - {JobState.QUEUED, JobState.PREEMPTED},
                                 is_array_parent=False).count()
    return {**node_selectors.cluster_gpus(taken),
            "jobs": {"queued": queue["n"], "queued_gpus": count_or_fraction(queue["g"] or 0), "running": running}}
