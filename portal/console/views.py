"""The admin console (staff only): fleet utilization, heat map, queue, health, revenue.

Charts are drawn in the browser by static/js/console_charts.js with the vendored uPlot; the page
hands it the numbers as JSON (json_script: data, never executed, so the CSP's script-src 'self'
holds). Every figure is also in a table, for readers without JavaScript.
"""
from datetime import datetime, timezone as dt_timezone

from django.contrib.auth.mixins import LoginRequiredMixin, UserPassesTestMixin
from django.http import HttpResponseBadRequest
from django.utils import timezone
from django.views.generic import TemplateView

from portal.metrics.selectors import DEFAULT_RANGE, RANGES

from . import selectors


class StaffRequiredMixin(LoginRequiredMixin, UserPassesTestMixin):
    """Anonymous visitors go to the login page; signed-in non-staff get 403."""

    def test_func(self):
        return self.request.user.is_staff


def _epoch(dt) -> int:
    return int(dt.timestamp())


def _day(day) -> int:
    return _epoch(datetime.combine(day, datetime.min.time(), dt_timezone.utc))


def chart_data(*, fleet: list[dict], revenue: dict, start, end) -> dict:
    """What console_charts.js draws: columns of numbers, times in epoch seconds (UTC)."""
    return {
        "start": _epoch(start), "end": _epoch(end),
        "fleet": {
            "t": [_epoch(r["bucket"]) for r in fleet],
            "gpus": [r["gpus"] for r in fleet],
            "allocated": [round(r["allocated_gpus"], 3) for r in fleet],
            "used": [round(r["used_gpus"], 3) for r in fleet],
            "queued": [r["queued_jobs"] for r in fleet],
            "wait_min": [None if r["wait_avg_s"] is None else round(r["wait_avg_s"] / 60, 2) for r in fleet],
        },
        "revenue": {
            "t": [_day(d["day"]) for d in revenue["days"]],
            "amount": [round(d["a"], 2) for d in revenue["days"]],
            "first": _epoch(revenue["month"]), "last": _day(revenue["last_day"]),
        },
        "currency": revenue["currency"],
    }


class ConsoleView(StaffRequiredMixin, TemplateView):
    template_name = "console/index.html"

    def get(self, request, *args, **kwargs):
        key = request.GET.get("range", DEFAULT_RANGE)
        if key not in RANGES:
            return HttpResponseBadRequest(f"range: use one of {', '.join(RANGES)}.", content_type="text/plain")
        self.time_range = RANGES[key]
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        now = timezone.now()
        fleet = selectors.fleet_series(time_range=self.time_range, now=now)
        heat = selectors.gpu_heat(now=now)
        idle = selectors.idle_allocated_gpus(now=now)
        fleet_table, queue_table = selectors.fleet_tables(fleet)
        revenue = selectors.revenue_this_month(now=now)
        return {
            **super().get_context_data(**kwargs),
            "ranges": RANGES.values(),
            "time_range": self.time_range,
            "range_start": now - self.time_range.span,
            "now": now,
            "fleet": fleet,
            "fleet_table": fleet_table,
            "queue_table": queue_table,
            "latest": fleet[-1] if fleet else None,
            "chart_data": chart_data(fleet=fleet, revenue=revenue, start=now - self.time_range.span, end=now),
            "heat": heat,
            "heat_window": selectors.HEAT_WINDOW,
            "heat_table": selectors.heat_table(heat["rows"]),
            "heat_columns": range(heat["columns"]),
            "unhealthy": selectors.unhealthy_gpus(),
            "idle": idle,
            "idle_table": selectors.idle_table(idle),
            "queue": selectors.queue_now(),
            "revenue": revenue,
        }
