"""The Prometheus collector behind /metrics: everything is computed at scrape time from
PostgreSQL and the latest sample per GPU in the cache, so any web process can answer a
scrape and nothing is lost when one restarts."""
from datetime import timedelta

from django.core.cache import cache
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

from portal.jobs.models import Allocation, Job, JobState
from portal.nodes.models import GPU, GPUHealth, Node, NodeState
from scheduler.core import REASON_FRAGMENTED

# Queue wait buckets (seconds): from "started at once" to "waited a day".
WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400)


class PortalCollector:
    def collect(self):
        yield from self._gpus()
        yield from self._jobs()
        yield from self._nodes()

    def _gpus(self):
        rows = list(GPU.objects.values_list("uuid", "node__name", "model", "memory_mb", "health"))
        samples = cache.get_many([f"gpu-sample:{r[0]}" for r in rows]) if rows else {}
        allocated = dict(Allocation.objects.filter(released_at__isnull=True).values("gpu__uuid")
                         .annotate(f=Sum("fraction")).values_list("gpu__uuid", "f"))
        labels = ["gpu_uuid", "node", "model"]
        util = GaugeMetricFamily("gpuportal_gpu_utilization_ratio", "GPU utilization, 0..1 (latest sample)",
                                 labels=labels)
        mem_used = GaugeMetricFamily("gpuportal_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
        mem_total = GaugeMetricFamily("gpuportal_gpu_memory_total_bytes", "GPU memory", labels=labels)
        temp = GaugeMetricFamily("gpuportal_gpu_temperature_celsius", "GPU temperature", labels=labels)
        power = GaugeMetricFamily("gpuportal_gpu_power_watts", "GPU power draw", labels=labels)
        healthy = GaugeMetricFamily("gpuportal_gpu_healthy", "1 if the scheduler may place on the GPU",
                                    labels=labels)
        alloc = GaugeMetricFamily("gpuportal_gpu_allocated_ratio", "Share of the GPU held by open allocations",
                                  labels=labels)
        total_alloc = 0.0
        healthy_count = 0
        for uuid, node, model, memory_mb, health in rows:
            values = [uuid, node, model]
            ok = health == GPUHealth.HEALTHY
            healthy_count += ok
            healthy.add_metric(values, 1.0 if ok else 0.0)
            share = float(allocated.get(uuid) or 0)
            total_alloc += share
            alloc.add_metric(values, share)
            mem_total.add_metric(values, float(memory_mb) * 2**20)
            s = samples.get(f"gpu-sample:{uuid}")
            if not isinstance(s, dict):
                continue  # no recent heartbeat: absent, not zero
            util.add_metric(values, _f(s.get("utilization")) / 100)
            mem_used.add_metric(values, _f(s.get("memory_used_mb")) * 2**20)
            temp.add_metric(values, _f(s.get("temperature_c")))
            power.add_metric(values, _f(s.get("power_w")))
        yield from (util, mem_used, mem_total, temp, power, healthy, alloc)
        fleet = GaugeMetricFamily("gpuportal_gpus_allocation_ratio",
                                  "Allocated GPUs over healthy GPUs in the fleet")
        fleet.add_metric([], total_alloc / healthy_count if healthy_count else 0.0)
        yield fleet
        count = GaugeMetricFamily("gpuportal_gpus", "GPUs by health", labels=["health"])
        for value in GPUHealth.values:
            count.add_metric([value], float(sum(1 for r in rows if r[4] == value)))
        yield count

    def _jobs(self):
        rows = (Job.objects.filter(is_array_parent=False).values("state")
                .annotate(n=Count("id"), frag=Count("id", filter=Q(reason_code=REASON_FRAGMENTED)))
                .values_list("state", "n", "frag").order_by())
        counts = {state: n for state, n, _ in rows}
        jobs = GaugeMetricFamily("gpuportal_jobs", "Jobs by state (array tasks counted, parents not)",
                                 labels=["state"])
        for state in JobState.values:
            jobs.add_metric([state], float(counts.get(state, 0)))
        yield jobs
        # The scheduler's fragmentation: jobs that would start if their GPUs could be split over nodes.
        yield GaugeMetricFamily("gpuportal_jobs_fragmented",
                                "Queued jobs waiting 'fragmented': enough GPUs free, but not on the nodes they need",
                                value=float(sum(f for state, _, f in rows if state == JobState.QUEUED)))
        # Cumulative over every job that ever started (first start), so it only grows like a
        # histogram must; one aggregate query whatever the number of jobs.
        wait = ExpressionWrapper(F("started_at") - F("submitted_at"), output_field=DurationField())
        started = Job.objects.filter(started_at__isnull=False, is_array_parent=False).annotate(w=wait)
        agg = started.aggregate(
            n=Count("id"), total=Sum("w"),
            **{f"le{i}": Count("id", filter=Q(w__lte=timedelta(seconds=b))) for i, b in enumerate(WAIT_BUCKETS)})
        buckets = [(str(float(b)), float(agg[f"le{i}"])) for i, b in enumerate(WAIT_BUCKETS)]
        buckets.append(("+Inf", float(agg["n"])))
        total = agg["total"].total_seconds() if agg["total"] is not None else 0.0
        yield HistogramMetricFamily("gpuportal_job_queue_wait_seconds", "Submit to first start",
                                    buckets=buckets, sum_value=total)

    def _nodes(self):
        counts = dict(Node.objects.values("state").annotate(n=Count("id")).values_list("state", "n").order_by())
        nodes = GaugeMetricFamily("gpuportal_nodes", "Nodes by state", labels=["state"])
        for state in NodeState.values:
            nodes.add_metric([state], float(counts.get(state, 0)))
        yield nodes


def _f(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def registry() -> CollectorRegistry:
    """A fresh registry per scrape: the collector holds no state between scrapes."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PortalCollector())
    return reg
