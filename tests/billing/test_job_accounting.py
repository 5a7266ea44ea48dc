"""Per-job accounting (sacct/seff): GPU-hours, efficiency from utilization rollups, cost; scoped."""
from datetime import date, timedelta
from decimal import Decimal

import pytest

from portal.billing.services import ratecard_set, usage_meter
from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.jobs.reports import job_report
from portal.metrics.models import GpuRollup, Resolution
from portal.nodes.models import Node
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

from tests.conftest import submit


@pytest.fixture
def ran(demo, clock, sent):
    """alice ran 2 GPUs for 50 minutes at 60% and 20% utilization; charlie 1 GPU in nlp."""
    admin = Actor(user=demo.users["admin"])
    node_add(actor=admin, name="gpu-01", gpus="4xH100-80GB")
    ratecard_set(actor=admin, gpu_model="H100-80GB", price_per_gpu_hour=Decimal("3"), effective_from=date(2026, 1, 1))
    demo.alices = submit(demo, name="train", resources={"gpus": 2})
    demo.charlies = submit(demo, user="charlie", project="nlp", name="secret", resources={"gpus": 1})
    run_pass()
    start = Allocation.objects.filter(job=demo.alices).first().started_at
    for a, util in zip(Allocation.objects.filter(job=demo.alices).order_by("gpu__index"), (60.0, 20.0)):
        GpuRollup.objects.bulk_create([
            GpuRollup(gpu=a.gpu, resolution=Resolution.MINUTE, bucket=start + timedelta(minutes=m), samples=6,
                      util_avg=util, util_max=util, memory_used_avg_mb=1, temperature_max_c=40, power_avg_w=100)
            for m in range(50)])
    # Work on the same GPU before the job started is not the job's.
    a0 = Allocation.objects.filter(job=demo.alices).order_by("gpu__index").first()
    GpuRollup.objects.create(gpu=a0.gpu, resolution=Resolution.MINUTE, bucket=start - timedelta(minutes=5),
                             samples=6, util_avg=100, util_max=100, memory_used_avg_mb=1, temperature_max_c=40,
                             power_avg_w=100)
    clock.advance(minutes=50)
    node = Node.objects.get(name="gpu-01")
    for job in (demo.alices, demo.charlies):
        job_report(node=node, job_id=str(job.pk), attempt=1, state="succeeded", exit_code=0)
    usage_meter()
    return demo


def test_job_accounting_gives_gpu_hours_efficiency_and_cost(ran, api):
    r = api("bob").get("/api/v1/usage/jobs/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["count"] == 1
    (row,) = body["results"]
    assert row["id"] == ran.alices.pk and row["user"] == "alice" and row["gpus"] == 2
    assert row["gpu_hours"] == pytest.approx(100 / 60, abs=0.001)
    assert row["gpu_efficiency"] == pytest.approx(0.40)
    assert row["amount"] == pytest.approx(5.0) and row["currency"] == "USD"
    assert row["elapsed"] is not None and row["gpu_types"] == ["H100-80GB"]
    assert body["total"]["gpu_hours"] == pytest.approx(100 / 60, abs=0.001)


def test_filters_by_user_project_job_and_range(ran, api):
    alice = api("alice")
    assert api("alice").get("/api/v1/usage/jobs/?user=bob").json()["count"] == 0
    assert alice.get(f"/api/v1/usage/jobs/?job={ran.alices.pk}").json()["count"] == 1
    assert alice.get("/api/v1/usage/jobs/?from=2026-11-04").json()["count"] == 0
    assert alice.get("/api/v1/usage/jobs/?from=2026-11-03&to=2026-11-04&project=vision").json()["count"] == 1
    bad = alice.get("/api/v1/usage/jobs/?from=yesterday&job=x&limit=0")
    assert bad.status_code == 400 and set(bad.json()["error"]["fields"]) == {"from", "job", "limit"}


def test_outsider_sees_no_job_and_other_project_is_404(ran, api):
    text = api("charlie").get("/api/v1/usage/jobs/").content.decode()
    assert "train" not in text and str(ran.charlies.pk) in text
    assert api("charlie").get(f"/api/v1/usage/jobs/?job={ran.alices.pk}").json()["count"] == 0
    assert api("charlie").get("/api/v1/usage/jobs/?project=vision").status_code == 404


def test_budget_and_quota_figures_are_numbers(ran, api):
    (budget,) = api("alice").get("/api/v1/budgets/").json()["results"]
    assert budget["budget_gpu_hours"] == 5000 and isinstance(budget["budget_gpu_hours"], int)
    assert budget["used_gpu_hours"] == pytest.approx(100 / 60, abs=0.001)
    quota = api("alice").get("/api/v1/projects/vision/").json()["quota"]
    assert (quota["guaranteed_gpus"], quota["max_gpus"], quota["gpu_hours_budget"]) == (8, 16, 5000)
    assert all(isinstance(quota[k], int) for k in ("guaranteed_gpus", "max_gpus", "gpu_hours_budget"))
