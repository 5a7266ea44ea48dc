"""Per-day usage sums (billing.UsageDay) follow the ledger through metering runs."""
from datetime import date
from decimal import Decimal

from portal.billing.models import UsageDay
from portal.billing.services import ratecard_set, usage_meter
from portal.console.selectors import revenue_this_month
from portal.core.context import Actor
from portal.jobs.models import Job
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

from tests.conftest import submit
from .test_metering import assert_usage_days_match_the_ledger, report


def test_days_follow_the_ledger_across_midnight_release_and_repricing(demo, clock, sent):
    admin = Actor(user=demo.users["admin"])
    node_add(actor=admin, name="gpu-01", gpus="2xH100-80GB")
    ratecard_set(actor=admin, gpu_model="H100-80GB", price_per_gpu_hour=Decimal("2.00"),
                 effective_from=date(2026, 1, 1))
    job = submit(demo, resources={"gpus": 1})
    other = submit(demo, user="charlie", project="nlp", resources={"gpus": 1})
    run_pass()
    for j in (job, other):
        report(j, "running")
    for _ in range(3):  # 09:40 on the 3rd to 15:40 on the 4th, metered every 10 hours
        clock.advance(hours=10)
        usage_meter()
        assert_usage_days_match_the_ledger()
    assert UsageDay.objects.filter(project=demo.vision).count() == 2
    # A card backdated to the 3rd re-prices the job's whole allocation when it is released.
    ratecard_set(actor=admin, gpu_model="H100-80GB", price_per_gpu_hour=Decimal("3.00"),
                 effective_from=date(2026, 11, 3))
    report(Job.objects.get(pk=job.pk), "succeeded", exit_code=0)
    clock.advance(minutes=5)
    usage_meter()
    assert_usage_days_match_the_ledger()
    usage_meter()  # a rerun changes nothing
    assert_usage_days_match_the_ledger()

    revenue = revenue_this_month()
    by_project = {r["project__slug"]: r for r in revenue["projects"]}
    assert set(by_project) == {"vision", "nlp"}
    assert abs(by_project["vision"]["hours"] - 30.0) < 0.01  # 09:40 to 15:40 the next day
    assert abs(by_project["vision"]["a"] - 90.0) < 0.01  # all of it at the backdated 3.00
