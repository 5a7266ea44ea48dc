"""GPU samples from heartbeats, health rules the scheduler obeys, rollups, and /metrics."""
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job
from portal.metrics.models import FleetRollup, GpuRollup, GpuSample
from portal.metrics.services import metrics_prune, rollup_hours, rollup_minutes, samples_flush, samples_write
from portal.nodes.models import GPU
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import make_token
from tests.conftest import submit as submit_job

SCRAPE = "s" * 40


def sample(gpu, **over):
    return {"gpu_uuid": gpu.uuid, "ts": datetime.now(dt_timezone.utc).timestamp(), "utilization": 42,
            "memory_used_mb": 1024, "memory_total_mb": 81920, "temperature_c": 55, "power_w": 300,
            "power_limit_w": 700, "ecc_errors": 0, "xid_errors": [], "processes": [], **over}


@pytest.fixture
def node(demo, monkeypatch, settings):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    settings.METRICS_INGEST_BATCH = 1  # write through: the tests read rows right after a heartbeat
    node, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    client.node = node
    client.gpus = list(node.gpus.order_by("index"))
    return client


def beat(client, samples):
    r = client.post("/api/agent/v1/heartbeat", data={"samples": samples, "jobs": []}, format="json")
    assert r.status_code == 200, r.content
    return r


def submit(demo, gpus):
    return submit_job(demo, resources={"gpus": gpus})


def test_heartbeat_samples_are_stored(node):
    beat(node, [sample(g, utilization=10 * (i + 1)) for i, g in enumerate(node.gpus)])
    rows = dict(GpuSample.objects.values_list("gpu_id", "utilization"))
    assert rows == {node.gpus[0].pk: 10.0, node.gpus[1].pk: 20.0}
    # A sample for a GPU that is not this node's is dropped, not stored against another GPU.
    beat(node, [{**sample(node.gpus[0]), "gpu_uuid": "GPU-elsewhere"}])
    assert GpuSample.objects.count() == 2


@pytest.mark.parametrize("bad", [{"temperature_c": 97}, {"xid_errors": [79]}, {"ecc_errors": 3}])
def test_unhealthy_gpu_is_avoided_by_the_scheduler(node, demo, bad):
    hot, cool = node.gpus
    beat(node, [sample(hot, **bad), sample(cool)])
    hot.refresh_from_db()
    assert hot.health == "unhealthy" and hot.health_reason
    job = submit(demo, 1)
    run_pass()
    assert Job.objects.get(pk=job.pk).state == "assigned"
    assert list(Allocation.objects.filter(job=job).values_list("gpu_id", flat=True)) == [cool.pk]
    both = submit(demo, 2)
    run_pass()
    assert Job.objects.get(pk=both.pk).state == "queued"


def test_gpu_cooled_down_comes_back_but_xid_stays(node, settings):
    hot, other = node.gpus
    beat(node, [sample(hot, temperature_c=95), sample(other, xid_errors=[48])])
    beat(node, [sample(hot, temperature_c=settings.GPU_HEALTH_MAX_TEMP_C - 2)])  # not cool enough yet
    assert GPU.objects.get(pk=hot.pk).health == "unhealthy"
    beat(node, [sample(hot, temperature_c=60), sample(other)])
    assert GPU.objects.get(pk=hot.pk).health == "healthy"
    assert GPU.objects.get(pk=other.pk).health == "unhealthy"  # an Xid needs an operator


def test_ignored_xid_is_not_a_fault(node, settings):
    settings.GPU_HEALTH_IGNORED_XIDS = [13]
    beat(node, [sample(node.gpus[0], xid_errors=[13])])
    assert GPU.objects.get(pk=node.gpus[0].pk).health == "healthy"


def test_heartbeat_samples_are_buffered_into_batches(node, settings):
    settings.METRICS_INGEST_BATCH = 5
    settings.METRICS_INGEST_FLUSH_S = 3600
    beat(node, [sample(g) for g in node.gpus])
    beat(node, [sample(g) for g in node.gpus])
    assert GpuSample.objects.count() == 0  # 4 rows buffered
    beat(node, [sample(g) for g in node.gpus])
    assert GpuSample.objects.count() == 6  # one COPY of all six
    beat(node, [sample(node.gpus[0])])
    assert samples_flush() == 1 and GpuSample.objects.count() == 7


@pytest.mark.clock
def test_rollups_and_pruning(node, settings, clock):
    gpu = node.gpus[0]
    base = clock().replace(minute=0, second=0, microsecond=0)  # this hour: the last of a month or year too
    rows = [(gpu.pk, base + timedelta(seconds=10 * i), float(i % 2) * 100, 100, 200, 50.0 + i, 100.0, 0, [])
            for i in range(12)]  # two minutes: utilization alternates 0/100
    samples_write(rows)
    assert rollup_minutes(now=base + timedelta(minutes=2, seconds=5)) == 2
    assert rollup_minutes(now=base + timedelta(minutes=2, seconds=5)) == 2  # re-run: upserted
    minutes = list(GpuRollup.objects.filter(resolution=60).order_by("bucket").values_list(
        "samples", "util_avg", "util_max", "temperature_max_c"))
    assert minutes == [(6, 50.0, 100.0, 55.0), (6, 50.0, 100.0, 61.0)]
    rollup_hours(now=base + timedelta(minutes=3))
    (hour,) = GpuRollup.objects.filter(resolution=3600).values_list("bucket", "samples", "util_avg")
    assert hour == (base, 12, 50.0)
    assert FleetRollup.objects.filter(resolution=60).count() == 5
    settings.METRICS_RAW_DAYS = 1
    assert metrics_prune(now=base + timedelta(days=2))["samples"] == 12


def parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_for_staff_session_and_token_and_scrape_token(node, demo, api, settings):
    beat(node, [sample(node.gpus[0], utilization=75, temperature_c=61)])
    submit(demo, 1)
    run_pass()
    r = api("admin").get("/metrics")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/plain")
    families = parse(r.content.decode())
    util = {s.labels["gpu_uuid"]: s.value for s in families["gpuportal_gpu_utilization_ratio"].samples}
    assert util == {node.gpus[0].uuid: 0.75}
    (first,) = [s for s in families["gpuportal_gpu_temperature_celsius"].samples]
    assert first.labels == {"gpu_uuid": node.gpus[0].uuid, "node": "gpu-01", "model": "H100-80GB"}
    jobs = {s.labels["state"]: s.value for s in families["gpuportal_jobs"].samples}
    assert jobs["assigned"] == 1
    assert {s.labels["state"]: s.value for s in families["gpuportal_nodes"].samples}["ready"] == 1
    assert families["gpuportal_job_queue_wait_seconds"].type == "histogram"
    assert families["gpuportal_gpus_allocation_ratio"].samples[0].value == 0.5
    assert "gpuportal_gpu_memory_total_bytes" in families and "gpuportal_gpu_healthy" in families
    staff_token = make_token(demo.users["admin"], ["read"])
    assert api(token=staff_token).get("/metrics").status_code == 200
    assert api(token=make_token(demo.users["alice"], ["read"])).get("/metrics").status_code == 403
    assert api("alice").get("/metrics").status_code == 403
    assert api().get("/metrics").status_code == 401
    assert api(token=SCRAPE).get("/metrics").status_code == 401  # not configured yet
    settings.METRICS_SCRAPE_TOKEN = SCRAPE
    assert api(token=SCRAPE).get("/metrics").status_code == 200


def test_metrics_query_count_is_flat(node, demo, api, django_assert_max_num_queries):
    for _ in range(5):
        submit(demo, 1)
    run_pass()
    client = api("admin")
    with django_assert_max_num_queries(12):
        assert client.get("/metrics").status_code == 200


def test_a_hot_gpu_whose_scrub_failed_meanwhile_does_not_heal_by_cooling(node):
    from portal.jobs.node_effects import gpus_scrub_failed

    hot = node.gpus[0]
    beat(node, [sample(hot, temperature_c=95)])  # unhealthy for heat (the health map caches that reason)
    gpus_scrub_failed(node=hot.node, failures=[{"gpu_index": hot.index, "message": "CUDA_ERROR_UNKNOWN"}], job_id=7)
    beat(node, [sample(hot, temperature_c=40)])
    hot.refresh_from_db()
    assert hot.health == "unhealthy" and "Memory scrub failed after job 7" in hot.health_reason


def test_jobs_waiting_fragmented_are_counted(node, demo, api, settings):
    """One GPU free on each of two nodes: a 2-GPU job waits fragmented and the gauge says 1."""
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-02", gpus="2xH100-80GB")
    settings.SCHEDULER_PLACEMENT = "spread"
    submit(demo, 1)
    submit(demo, 1)
    run_pass()
    pair = submit(demo, 2)
    run_pass()
    pair.refresh_from_db()
    assert pair.reason_code == "fragmented"
    families = parse(api("admin").get("/metrics").content.decode())
    assert families["gpuportal_jobs_fragmented"].samples[0].value == 1
