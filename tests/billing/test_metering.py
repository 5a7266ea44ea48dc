"""The ledger: billed GPU-seconds equal allocated GPU-seconds, once, whatever happens to jobs."""
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, transaction
from django.db.models import Sum

from portal.billing.models import Invoice, UsageRecord
from portal.billing.services import invoices_generate, ratecard_set, reconcile, usage_meter
from portal.core.context import Actor
from portal.jobs.models import Allocation, Job
from portal.jobs.reports import job_report
from portal.jobs.services import job_cancel
from portal.nodes.models import Node
from portal.jobs.node_effects import nodes_reap
from portal.nodes.services import node_add
from scheduler.adapter import _apply_preemption, run_pass
from scheduler.core.model import Preemption

from tests.conftest import submit


def heartbeat(*names, clock):
    Node.objects.filter(name__in=names).update(last_heartbeat_at=clock())


def report(job, state, **kw):
    job.refresh_from_db()
    node = Node.objects.get(pk=job.node_id)
    return job_report(node=node, job_id=str(job.pk), attempt=job.attempt, state=state, **kw)


def allocated_seconds(alloc, now) -> float:
    return ((alloc.released_at or now) - alloc.started_at).total_seconds() * float(alloc.fraction)


def billed_seconds(alloc) -> float:
    return float(UsageRecord.objects.filter(allocation=alloc).aggregate(s=Sum("gpu_seconds"))["s"] or 0)


@pytest.fixture
def fleet(demo, clock, sent):
    admin = Actor(user=demo.users["admin"])
    node_add(actor=admin, name="gpu-01", gpus="4xH100-80GB")
    node_add(actor=admin, name="gpu-02", gpus="1xA100-80GB", shared=True)
    node_add(actor=admin, name="gpu-03", gpus="2xH100-80GB")
    heartbeat("gpu-01", "gpu-02", "gpu-03", clock=clock)
    ratecard_set(actor=admin, gpu_model="H100-80GB", price_per_gpu_hour=Decimal("2.50"),
                 effective_from=date(2026, 1, 1), qos_multipliers={"preemptible": 0.5, "high": 1.5})
    ratecard_set(actor=admin, gpu_model="*", price_per_gpu_hour=Decimal("1.00"), effective_from=date(2026, 1, 1))
    return demo


def test_billing_invariant_after_a_mixed_run(fleet, clock, settings):
    """Jobs succeed, fail, are cancelled, preempted and requeued, lose their node; metering runs
    at odd moments and twice in a row. Every allocation is billed to within 1 s, once."""
    settings.SCHEDULER_MIN_RUNTIME_S = 0
    demo = fleet
    ok = submit(demo, resources={"gpus": 2})
    fails = submit(demo, resources={"gpus": 1}, preemptible=True)
    half = submit(demo, resources={"gpus": 0.5})
    quarter = submit(demo, user="charlie", project="nlp", resources={"gpus": 0.25})
    run_pass()
    assigned = {j.pk: Job.objects.get(pk=j.pk) for j in (ok, fails, half, quarter)}
    assert all(j.state == "assigned" for j in assigned.values()), {j.pk: j.reason_message for j in assigned.values()}
    for j in (ok, fails, half, quarter):
        report(j, "running")

    clock.advance(minutes=35)  # 10:15: across an hour boundary
    heartbeat("gpu-01", "gpu-02", "gpu-03", clock=clock)
    usage_meter()  # open allocations metered up to now
    report(fails, "failed", exit_code=1)
    # The agent of gpu-03 will be "killed": put a job there by filling gpu-01 first.
    filler = submit(demo, resources={"gpus": 2})
    moved = submit(demo, resources={"gpus": 2})
    run_pass()
    for j in (filler, moved):
        report(j, "running")
    victims = [j for j in (filler, moved) if Job.objects.get(pk=j.pk).node.name == "gpu-03"]
    assert victims, "one of the two should have landed on gpu-03"
    killed = victims[0]

    clock.advance(minutes=20)  # 10:35
    heartbeat("gpu-01", "gpu-02", clock=clock)  # gpu-03 is silent from now on
    cancelled = filler if killed is moved else moved
    job_cancel(actor=Actor(user=demo.users["alice"]), job=Job.objects.get(pk=cancelled.pk))
    report(half, "succeeded", exit_code=0)
    # Preempted and requeued (what a scheduling pass applies for a higher-priority job).
    _apply_preemption(Preemption(job_id=str(ok.pk), reason="test", by_job_id="0"), {})
    usage_meter()
    usage_meter()  # a duplicated beat delivery

    clock.advance(seconds=settings.NODE_TIMEOUT_S + 5)
    heartbeat("gpu-01", "gpu-02", clock=clock)
    assert nodes_reap()["requeued"] == 1
    run_pass()  # the preempted and the node-lost jobs start again as attempt 2
    for j in (ok, killed):
        j.refresh_from_db()
        assert j.state == "assigned" and j.attempt == 2
        report(j, "running")

    clock.advance(hours=1, minutes=7, seconds=13)  # 11:43:xx
    heartbeat("gpu-01", "gpu-02", clock=clock)
    report(ok, "succeeded", exit_code=0)
    report(killed, "succeeded", exit_code=0)
    usage_meter()
    clock.advance(minutes=3)
    usage_meter()  # the quarter GPU job is still running: metered up to now

    now = clock()
    allocs = list(Allocation.objects.all())
    assert len(allocs) >= 9
    for alloc in allocs:
        assert abs(billed_seconds(alloc) - allocated_seconds(alloc, now)) <= 1.0, alloc.pk
    assert reconcile() == []
    assert_usage_days_match_the_ledger()
    # Fractions are billed by fraction.
    (q,) = Allocation.objects.filter(job=quarter)
    assert abs(billed_seconds(q) - (now - q.started_at).total_seconds() * 0.25) <= 1.0
    # Running the meter again changes nothing.
    before = list(UsageRecord.objects.order_by("id").values_list("id", "gpu_seconds", "amount"))
    usage_meter()
    assert list(UsageRecord.objects.order_by("id").values_list("id", "gpu_seconds", "amount")) == before

    # Invoices: totals equal the sum of the month's records, per organization; regenerating is idempotent.
    invoices = invoices_generate(actor=Actor(user=demo.users["admin"]), month=date(2026, 11, 1))
    again = invoices_generate(actor=Actor(user=demo.users["admin"]), month=date(2026, 11, 1))
    assert [i.pk for i in invoices] == [i.pk for i in again] and Invoice.objects.count() == 2
    for invoice in again:
        records = UsageRecord.objects.filter(organization=invoice.organization).aggregate(
            s=Sum("gpu_seconds"), a=Sum("amount"))
        assert invoice.total == records["a"] and invoice.gpu_seconds == records["s"]
        assert sum(line.amount for line in invoice.lines.all()) == invoice.total


def assert_usage_days_match_the_ledger():
    """The console's per-day sums (billing.UsageDay) equal the ledger's, per project and day."""
    from django.db.models.functions import TruncDate

    from portal.billing.models import UsageDay

    ledger = {(r["d"], r["project_id"]): (r["s"], r["a"]) for r in UsageRecord.objects.annotate(
        d=TruncDate("hour")).values("d", "project_id").annotate(s=Sum("gpu_seconds"), a=Sum("amount"))}
    days = {(d.day, d.project_id): (d.gpu_seconds, d.amount) for d in UsageDay.objects.all()}
    assert days == ledger and ledger


def test_hour_buckets_and_price(fleet, clock):
    demo = fleet
    job = submit(demo, resources={"gpus": 1, "gpu_type": "H100-80GB"}, preemptible=True)
    run_pass()
    report(job, "running")
    clock.advance(hours=1)  # 09:40 -> 10:40
    report(job, "succeeded", exit_code=0)
    usage_meter()
    rows = list(UsageRecord.objects.order_by("hour").values_list("hour", "gpu_seconds", "unit_price", "amount",
                                                                 "final"))
    assert [(r[0].hour, r[1]) for r in rows] == [(9, Decimal("1200.000")), (10, Decimal("2400.000"))]
    # 2.50 per GPU-hour, preemptible x0.5: one hour costs 1.25.
    assert all(r[2] == Decimal("1.2500") and r[4] for r in rows)
    assert sum(r[3] for r in rows) == Decimal("1.25")


def test_duplicate_metering_is_a_no_op(fleet, clock):
    demo = fleet
    job = submit(demo, resources={"gpus": 1})
    run_pass()
    clock.advance(minutes=15)
    report(job, "succeeded", exit_code=0)
    for _ in range(3):
        usage_meter()
    assert UsageRecord.objects.count() == 1
    record = UsageRecord.objects.get()
    assert record.gpu_seconds == Decimal("900.000")
    # The unique key refuses a second row for the same (allocation, hour) outright.
    with pytest.raises(IntegrityError), transaction.atomic():
        UsageRecord.objects.create(**{f.attname: getattr(record, f.attname) for f in UsageRecord._meta.fields
                                      if f.name != "id"})


def test_open_allocation_metered_before_release_is_corrected(fleet, clock):
    """A run that metered an open allocation up to a `now` past the release it had not yet seen
    (the release committed meanwhile) is corrected by the next run, hours past the end removed."""
    demo = fleet
    job = submit(demo, resources={"gpus": 1})
    run_pass()
    alloc = Allocation.objects.get(job=job)
    clock.advance(minutes=50)  # 10:30
    usage_meter()
    # The release happened at 09:55 but was committed after that run read the allocation.
    Allocation.objects.filter(pk=alloc.pk).update(released_at=alloc.started_at + timedelta(minutes=15))
    usage_meter()
    alloc.refresh_from_db()
    assert billed_seconds(alloc) == 900.0
    assert list(UsageRecord.objects.values_list("hour__hour", flat=True)) == [9]


def test_budget_warning_and_exceeded_alerts(fleet, clock, api):
    from portal.billing.models import BudgetAlert
    from portal.core.models import AuditEvent
    from portal.tenancy.models import Quota

    demo = fleet
    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=Decimal("1"))
    job = submit(demo, resources={"gpus": 1})
    run_pass()
    clock.advance(minutes=50)
    usage_meter()
    assert list(BudgetAlert.objects.values_list("level", flat=True)) == [80]
    r = api("dave").get("/api/v1/budgets/").json()["results"]
    assert [(b["project"], b["level"]) for b in r] == [("vision", "warning")]
    clock.advance(minutes=20)
    usage_meter()
    usage_meter()
    assert sorted(BudgetAlert.objects.values_list("level", flat=True)) == [80, 100]
    assert AuditEvent.objects.filter(action="budget.exceeded", project=demo.vision).count() == 1
    # The submit check refuses new GPU work (409) now that the month's GPU-hours are spent.
    r = api("alice").post("/api/v1/jobs/", {"project": "vision", "name": "x", "image": "gpuportal/busybox:latest",
                                            "command": ["true"], "resources": {"gpus": 1}}, format="json")
    assert r.status_code == 409 and r.json()["error"]["code"] == "budget_exhausted"
    assert job.pk
