"""Pages that read metrics beside jobs: composed here, above both, so jobs never imports metrics."""
from django.http import JsonResponse
from django.views import View

from portal.core.pages import PageMixin, scoped_or_404
from portal.jobs.models import TERMINAL, Allocation, Job
from portal.jobs.selectors import job_gpu_samples

from .selectors import gpu_minutes

# A sample's own figures: `processes` may name other tenants' work and is never shown.
SAMPLE_KEYS = ("ts", "utilization", "memory_used_mb", "memory_total_mb", "temperature_c", "power_w", "power_limit_w")


class JobMetricsView(PageMixin, View):
    """JSON for the GPU charts: the latest sample of each GPU the job holds; with ?history=1 also
    the attempt's minute rollups since it got its GPUs (the last 24 h at most), so the charts
    start at the job's start rather than when the page was opened."""

    def get(self, request, pk):
        job = scoped_or_404(Job.objects.select_related("project"), request, pk=pk)
        gpus = []
        for g in job_gpu_samples(job):
            sample = g["sample"] or {}
            gpus.append({**{k: g[k] for k in ("uuid", "index", "node", "model", "fraction", "open")},
                         # Only this GPU's own figures: `processes` may name other tenants' work.
                         "sample": {k: sample.get(k) for k in SAMPLE_KEYS} if g["sample"] else None})
        allocs = list(Allocation.objects.filter(job=job, attempt=job.attempt).values_list("gpu_id", "gpu__uuid",
                                                                                          "started_at"))
        started = min((a[2] for a in allocs), default=job.started_at)
        # live: keep polling while the job may still get or hold GPUs. started/ended: the x axis's ends.
        body = {"job": job.pk, "state": job.state, "live": job.state not in TERMINAL, "gpus": gpus,
                "started": int(started.timestamp()) if started else None,
                "ended": int(job.ended_at.timestamp()) if job.ended_at and job.state in TERMINAL else None}
        if request.GET.get("history") and started:
            history = gpu_minutes(gpu_ids=[a[0] for a in allocs], start=started)
            uuid = {a[0]: a[1] for a in allocs}
            body["history"] = {"t": history["t"], "gpus": {uuid[k]: v for k, v in history["gpus"].items()}}
        return JsonResponse(body)
