"""Month boundaries: usage, budgets and invoices count only the part of an allocation inside the
UTC month (or day) they are about, at every instant of --clock-instants (tests/clock.py)."""
import io
from datetime import date, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.management import call_command

from portal.billing.models import BudgetAlert, Invoice
from portal.billing.services import ratecard_set, usage_meter
from portal.console.selectors import revenue_this_month
from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.jobs.selectors import gpu_hours_used_this_month
from portal.nodes.services import node_add
from portal.tenancy.models import Quota

from tests.conftest import submit


def months(start: datetime, end: datetime) -> list[datetime]:
    """The first instants of the UTC months [start, end) touches."""
    out, m = [], start.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    while m < end:
        out.append(m)
        m = (m + timedelta(days=32)).replace(day=1)
    return out


def overlap_s(start: datetime, end: datetime, lo: datetime, hi: datetime) -> float:
    return max(0.0, (min(end, hi) - max(start, lo)).total_seconds())


@pytest.fixture
def gpu(demo, sent):
    admin = Actor(user=demo.users["admin"])
    node, _ = node_add(actor=admin, name="gpu-01", gpus="1xH100-80GB")
    return node.gpus.get()


def allocate(demo, gpu, started_at, released_at=None) -> Allocation:
    return Allocation.objects.create(job=submit(demo, resources={"gpus": 1}), attempt=1, gpu=gpu,
                                     started_at=started_at, released_at=released_at)


@pytest.mark.clock
def test_an_allocation_across_months_is_split_between_them(clock, demo, gpu, api):
    """It began 30 minutes before this month and ends 10 minutes from now: at the end of a month
    (or year) that is three months, each invoiced, budgeted and reported for its own part, at the
    price in force in it."""
    admin = Actor(user=demo.users["admin"])
    ratecard_set(actor=admin, gpu_model="H100-80GB", price_per_gpu_hour=Decimal("2.00"), effective_from=date(2020, 1, 1))
    repriced = clock.month_start  # a new price from the start of this month on
    ratecard_set(actor=admin, gpu_model="H100-80GB", price_per_gpu_hour=Decimal("3.00"), effective_from=repriced.date())
    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=Decimal(10000))
    start = clock.month_start - timedelta(minutes=30)
    alloc = allocate(demo, gpu, start)
    usage_meter()  # metered open, up to now
    clock.advance(minutes=10)
    end = clock()
    Allocation.objects.filter(pk=alloc.pk).update(released_at=end)
    usage_meter()

    spans = months(start, end)
    assert len(spans) == (3 if end.month != (end - timedelta(minutes=10)).month else 2)
    for m in spans:
        call_command("invoice", "--month", f"{m:%Y-%m}", "--no-meter", stdout=io.StringIO())
    invoices = {i.month: i for i in Invoice.objects.filter(organization__slug="acme")}
    assert sorted(invoices) == [m.date() for m in spans]
    for i, m in enumerate(spans):
        seconds = overlap_s(start, end, m, spans[i + 1] if i + 1 < len(spans) else end)
        price = Decimal("2.00") if m < repriced else Decimal("3.00")
        invoice = invoices[m.date()]
        assert invoice.gpu_seconds == Decimal(seconds).quantize(Decimal("0.001")), m
        assert abs(invoice.total - Decimal(seconds) * price / 3600) < Decimal("0.0001"), m
    assert sum(i.gpu_seconds for i in invoices.values()) == Decimal((end - start).total_seconds())

    # This month's budget counts this month's part only: from the ledger and from allocations.
    this_month = spans[-1]
    hours = overlap_s(start, end, this_month, end) / 3600
    (budget,) = api("alice").get("/api/v1/budgets/").json()["results"]
    assert budget["month"] == f"{this_month:%Y-%m}"
    assert abs(float(budget["used_gpu_hours"]) - hours) < 0.001
    assert abs(gpu_hours_used_this_month([demo.vision.pk])[demo.vision.pk] - hours) < 0.001
    (row,) = revenue_this_month()["projects"]
    assert abs(row["hours"] - hours) < 0.001

    # Per UTC day too (29 February included).
    days = api("alice").get("/api/v1/usage/?group_by=day").json()["results"]
    day = start.replace(hour=0, minute=0)
    expected = []
    while day < end:
        expected.append((day.date().isoformat(), f"{overlap_s(start, end, day, day + timedelta(days=1)):.3f}"))
        day += timedelta(days=1)
    assert [(d["day"], d["gpu_seconds"]) for d in days] == expected


@pytest.mark.clock
def test_last_months_budget_alerts_come_from_the_first_run_of_the_new_month(clock, demo, gpu):
    """Usage of last month that no metering run saw before midnight (the last minute, or an
    outage) still raises last month's alerts, and none for this month."""
    from portal.core.models import AuditEvent

    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=Decimal("0.5"))
    allocate(demo, gpu, clock.month_start - timedelta(minutes=45), clock.month_start - timedelta(minutes=5))
    usage_meter()
    last_month = (clock.month_start - timedelta(days=1)).date().replace(day=1)
    assert sorted(BudgetAlert.objects.values_list("month", "level")) == [(last_month, 80), (last_month, 100)]
    event = AuditEvent.objects.get(action="budget.exceeded", project=demo.vision)
    assert event.data["month"] == f"{last_month:%Y-%m}"
    usage_meter()
    assert BudgetAlert.objects.count() == 2


@pytest.mark.clock
def test_budget_page_alerts_and_the_budget_stop_read_one_figure(clock, demo, gpu, api):
    """An open allocation no metering run has seen yet counts at once, the same on the budgets
    page, in the alerts and in the figure the scheduler's budget stop reads; last month's part
    of it counts for last month only."""
    from portal.billing.services import budgets_check

    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=Decimal("0.5"))
    start = clock.month_start
    allocate(demo, gpu, start - timedelta(minutes=20))
    clock.move_to(start + timedelta(minutes=36))  # 36 minutes of this month, 20 of the last: no meter has run
    (budget,) = api("alice").get("/api/v1/budgets/").json()["results"]
    assert budget["used_gpu_hours"] == pytest.approx(0.6, abs=0.001)
    assert budget["level"] == "exceeded"
    assert gpu_hours_used_this_month([demo.vision.pk])[demo.vision.pk] == pytest.approx(0.6, abs=0.001)
    assert budgets_check(since=start - timedelta(days=1)) == 2
    this_month = start.date()
    assert sorted(BudgetAlert.objects.values_list("month", "level")) == [(this_month, 80), (this_month, 100)]
    assert BudgetAlert.objects.get(level=100).used_gpu_hours == Decimal("0.600")
