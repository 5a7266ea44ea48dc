"""The console's autoscaling page (staff only): each pool's size, waiting demand and GPU-hours paid
against used; its size over the last 24 hours; the scale events with their reasons."""
from datetime import timedelta

from django.utils import timezone
from django.views.generic import TemplateView

from portal.autoscale import selectors

from .views import StaffRequiredMixin


class AutoscaleConsoleView(StaffRequiredMixin, TemplateView):
    template_name = "autoscale/console.html"

    def get_context_data(self, **kwargs):
        now = timezone.now()
        series = selectors.size_series(since=now - timedelta(hours=24), now=now, step_s=3600)
        pools = selectors.pool_summaries(now=now)
        return {
            **super().get_context_data(**kwargs),
            "now": now,
            "pools": pools,
            "size_pools": list(series["pools"]),
            "size_rows": [(t, [series["pools"][p][i] for p in series["pools"]]) for i, t in enumerate(series["times"])],
            "events": selectors.recent_events(),
        }
