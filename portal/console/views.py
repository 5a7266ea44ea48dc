"""The admin console (staff only): fleet utilization, heat map, queue, health, revenue."""
from django.contrib.auth.mixins import LoginRequiredMixin, UserPassesTestMixin
from django.views.generic import TemplateView

from . import charts, selectors


class StaffRequiredMixin(LoginRequiredMixin, UserPassesTestMixin):
    """Anonymous visitors go to the login page; signed-in non-staff get 403."""

    def test_func(self):
        return self.request.user.is_staff


class ConsoleView(StaffRequiredMixin, TemplateView):
    template_name = "console/index.html"

    def get_context_data(self, **kwargs):
        fleet = selectors.fleet_series()
        labels = [r["label"] for r in fleet]
        heat = selectors.gpu_heat()
        idle = selectors.idle_allocated_gpus()
        revenue = selectors.revenue_this_month()
        return {
            **super().get_context_data(**kwargs),
            "fleet": fleet,
            "fleet_chart": charts.line_chart(
                [("GPUs", [r["gpus"] for r in fleet]), ("allocated", [r["allocated_gpus"] for r in fleet]),
                 ("used", [r["used_gpus"] for r in fleet])], labels, title="Fleet: GPUs allocated vs used"),
            "queue_chart": charts.line_chart(
                [("queued jobs", [r["queued_jobs"] for r in fleet]),
                 ("mean wait (min)", [(r["wait_avg_s"] or 0) / 60 for r in fleet])], labels,
                title="Queue depth and wait"),
            "heat": heat,
            "heat_chart": charts.heat_map(heat["rows"], title="GPU utilization by node and GPU index"),
            "heat_table": selectors.heat_table(heat["rows"]),
            "heat_columns": range(max((len(v) for _, v in heat["rows"]), default=0)),
            "unhealthy": selectors.unhealthy_gpus(),
            "idle": idle,
            "idle_table": selectors.idle_table(idle),
            "queue": selectors.queue_now(),
            "revenue": revenue,
            "org_chart": charts.bar_chart([(r["organization__slug"], r["a"]) for r in revenue["organizations"]],
                                          title="Revenue by organization this month"),
            "project_chart": charts.bar_chart([(r["project__slug"], r["a"]) for r in revenue["projects"][:30]],
                                              title="Revenue by project this month"),
        }
