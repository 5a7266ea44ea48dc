"""Writes for billing: metering allocations into the ledger, invoices, budget alerts, rate cards."""
import logging
from collections import defaultdict
from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from portal.core import locks
from portal.core.context import Actor
from portal.core.errors import Conflict, InvalidInput
from portal.core.services import audit_record, require_operator
from portal.jobs.models import Allocation
from portal.jobs.selectors import gpu_hours_used
from portal.tenancy.models import Quota

from .models import (AllocationMeter, BudgetAlert, Invoice, InvoiceLine, InvoiceStatus, RateCard, UsageDay,
                     UsageRecord)

log = logging.getLogger(__name__)

HOUR = timedelta(hours=1)
SECONDS_Q = Decimal("0.001")
AMOUNT_Q = Decimal("0.000001")
SYSTEM = Actor(user=None, label="billing")


def hour_floor(dt: datetime) -> datetime:
    return dt.astimezone(dt_timezone.utc).replace(minute=0, second=0, microsecond=0)


def month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime(month.year, month.month, 1, tzinfo=dt_timezone.utc)
    end = datetime(month.year + (month.month == 12), month.month % 12 + 1, 1, tzinfo=dt_timezone.utc)
    return start, end


def hour_overlaps(start: datetime, end: datetime) -> list[tuple[datetime, float]]:
    """[(hour, seconds)] for each UTC hour that [start, end) touches with a positive overlap."""
    out = []
    hour = hour_floor(start)
    while hour < end:
        seconds = (min(end, hour + HOUR) - max(start, hour)).total_seconds()
        if seconds > 0:
            out.append((hour, seconds))
        hour += HOUR
    return out


class RateBook:
    """Rate cards loaded once per run: the latest card effective on a day, per GPU model ("*" fallback)."""

    def __init__(self):
        self.cards: dict[str, list[RateCard]] = defaultdict(list)
        for card in RateCard.objects.order_by("-effective_from"):
            self.cards[card.gpu_model].append(card)

    def card(self, gpu_model: str, day: date) -> RateCard | None:
        for model in (gpu_model, "*"):
            for card in self.cards.get(model, ()):
                if card.effective_from <= day:
                    return card
        return None

    def price(self, *, gpu_model: str, day: date, preemptible: bool, priority: str) -> tuple[Decimal, str]:
        card = self.card(gpu_model, day)
        if card is None:
            return Decimal(0), settings.BILLING_CURRENCY
        return card.price_per_gpu_hour * card.multiplier(preemptible=preemptible, priority=priority), card.currency


def usage_meter(*, now: datetime | None = None, batch: int = 500) -> dict:
    """Write the ledger for every allocation not yet metered to its release.

    1. Under an advisory lock (a second concurrent run returns at once: its work would be the
       same), pick allocations whose meter is not closed.
    2. For each, the hours to (re)compute: all of them for a released allocation (this fixes
       any hour an earlier run metered up to a `now` past the release it had not seen yet);
       for an open one, from the hour of the last run's `now` up to `now`.
    3. Upsert one UsageRecord per (allocation, hour) with the hour's *total* GPU-seconds
       (overlap x fraction) and amount. Hours past the release are deleted.
    4. Move the meter: closed once metered after release. Then check budgets.
    Billed GPU-seconds therefore equal allocated GPU-seconds to the millisecond once an
    allocation is released, and up to `now` while it is open.
    """

    now = now or timezone.now()
    rates = RateBook()
    written = closed = 0
    with transaction.atomic():
        if not locks.try_xact_lock(locks.USAGE_METER):
            return {"skipped": "another metering run is in progress"}
        pending = Allocation.objects.filter(
            ~Exists(AllocationMeter.objects.filter(allocation=OuterRef("pk"), closed=True)), started_at__lt=now,
        ).values("id", "started_at", "released_at", "fraction", "gpu__model", "job_id", "job__project_id",
                 "job__project__organization_id", "job__user_id", "job__preemptible", "job__priority",
                 "meter__metered_until")
        rows = list(pending)
        for i in range(0, len(rows), batch):
            w, c = _meter_batch(rows[i:i + batch], now, rates)
            written += w
            closed += c
        since = min((_first_rewritten_hour(row) for row in rows), default=None)
        if since is not None:
            usage_days_rebuild(since=since)
        alerts = budgets_check(now=now, since=since)
    return {"allocations": len(rows), "records": written, "closed": closed, "budget_alerts": alerts}


def _meter_batch(rows: list[dict], now: datetime, rates: RateBook) -> tuple[int, int]:
    records: list[UsageRecord] = []
    meters: list[AllocationMeter] = []
    trim: list[tuple[int, datetime]] = []
    closed = 0
    for row in rows:
        released = row["released_at"]
        end = released or now
        start = row["started_at"]
        if released is None and row["meter__metered_until"] is not None:
            # Hours before the last run's hour are complete and cannot change while it is open.
            start = max(start, hour_floor(row["meter__metered_until"]))
        fraction = Decimal(row["fraction"])
        for hour, seconds in hour_overlaps(start, end):
            # Whole hours of the allocation: the overlap with the allocation, not with `start`.
            seconds = (min(end, hour + HOUR) - max(row["started_at"], hour)).total_seconds()
            gpu_seconds = (Decimal(str(seconds)) * fraction).quantize(SECONDS_Q, ROUND_HALF_UP)
            unit, currency = rates.price(gpu_model=row["gpu__model"], day=hour.date(),
                                         preemptible=row["job__preemptible"], priority=row["job__priority"])
            records.append(UsageRecord(
                allocation_id=row["id"], hour=hour, project_id=row["job__project_id"],
                organization_id=row["job__project__organization_id"], user_id=row["job__user_id"],
                job_id=row["job_id"], gpu_model=row["gpu__model"], fraction=fraction,
                preemptible=row["job__preemptible"], priority=row["job__priority"], gpu_seconds=gpu_seconds,
                unit_price=unit, currency=currency, final=released is not None, updated_at=now,
                amount=(gpu_seconds * unit / 3600).quantize(AMOUNT_Q, ROUND_HALF_UP),
            ))
        if released is not None:
            # The first hour the allocation does not touch: rows from there on were metered up to
            # a `now` past a release that run had not seen yet.
            trim.append((row["id"], hour_floor(released) + (HOUR if hour_floor(released) != released else timedelta(0))))
            closed += 1
        meters.append(AllocationMeter(allocation_id=row["id"], metered_until=end, closed=released is not None))
    if records:
        # ON CONFLICT (allocation, hour) DO UPDATE: totals replace totals, so a rerun changes nothing.
        UsageRecord.objects.bulk_create(
            records, update_conflicts=True, unique_fields=["allocation", "hour"],
            update_fields=["gpu_seconds", "amount", "unit_price", "currency", "final", "updated_at"])
    for allocation_id, first_hour_after in trim:
        UsageRecord.objects.filter(allocation_id=allocation_id, hour__gte=first_hour_after).delete()
    AllocationMeter.objects.bulk_create(meters, update_conflicts=True, unique_fields=["allocation"],
                                        update_fields=["metered_until", "closed"])
    return len(records), closed


def _first_rewritten_hour(row: dict) -> datetime:
    """The earliest hour _meter_batch rewrites for a pending allocation: every hour of a released
    or never-metered one (a released one is re-priced whole), else from the last run's hour."""
    if row["released_at"] is not None or row["meter__metered_until"] is None:
        return hour_floor(row["started_at"])
    return hour_floor(row["meter__metered_until"])


def usage_days_rebuild(*, since: datetime) -> int:
    """Recompute UsageDay rows from the UTC day of `since` on, from the ledger (call it in the
    metering transaction, after the ledger is written). Returns the rows written."""
    day = since.astimezone(dt_timezone.utc).date()
    start = datetime(day.year, day.month, day.day, tzinfo=dt_timezone.utc)
    sums = (UsageRecord.objects.filter(hour__gte=start).annotate(day=TruncDate("hour", tzinfo=dt_timezone.utc))
            .values("day", "project_id", "organization_id").annotate(s=Sum("gpu_seconds"), a=Sum("amount"))
            .order_by())
    days = [UsageDay(day=r["day"], project_id=r["project_id"], organization_id=r["organization_id"],
                     gpu_seconds=r["s"], amount=r["a"]) for r in sums]
    UsageDay.objects.filter(day__gte=day).delete()
    UsageDay.objects.bulk_create(days, batch_size=2000)
    return len(days)


def budgets_check(*, now: datetime | None = None, since: datetime | None = None) -> int:
    """Record a BudgetAlert (and an audit event) the first time a project passes 80% / 100% of
    its monthly GPU-hour budget, in the UTC month of `now` and in each month from `since` on: the
    run after midnight that meters the last minutes of the month before (or the first run after
    an outage) still alerts for that month. The scheduler enforces a hard stop itself from the
    same figure."""

    now = now or timezone.now()
    quotas = {q.project_id: q for q in Quota.objects.filter(gpu_hours_budget__gt=0).select_related("project")}
    if not quotas:
        return 0
    month = now.astimezone(dt_timezone.utc).date().replace(day=1)
    first = min(month, since.astimezone(dt_timezone.utc).date().replace(day=1)) if since else month
    created = 0
    while first <= month:
        created += _budgets_check_month(quotas, first, now)
        first = month_bounds(first)[1].date()
    return created


def _budgets_check_month(quotas: dict, month: date, now: datetime) -> int:
    """Alerts from the figure the scheduler's budget stop reads (jobs.selectors.gpu_hours_used): the
    warning, the stop and the budgets page never disagree, and none waits for metering."""
    used = gpu_hours_used(quotas, month=month_bounds(month)[0], now=now)
    done = set(BudgetAlert.objects.filter(project_id__in=list(quotas), month=month).values_list("project_id", "level"))
    warn = int(round(settings.BILLING_BUDGET_WARN_FRACTION * 100))
    created = 0
    for project_id, quota in quotas.items():
        share = used.get(project_id, 0.0) / float(quota.gpu_hours_budget)
        for level in (warn, 100):
            if share * 100 >= level and (project_id, level) not in done:
                alert, new = BudgetAlert.objects.get_or_create(
                    project_id=project_id, month=month, level=level,
                    defaults={"used_gpu_hours": Decimal(str(round(used[project_id], 3))),
                              "budget_gpu_hours": quota.gpu_hours_budget})
                if new:
                    created += 1
                    audit_record(actor=SYSTEM, action="budget.exceeded" if level >= 100 else "budget.warning",
                                 obj=quota.project, project=quota.project, level=level, month=f"{month:%Y-%m}",
                                 used_gpu_hours=str(alert.used_gpu_hours), budget=str(quota.gpu_hours_budget),
                                 hard_stop=quota.budget_hard_stop)
    return created


def parse_month(text: str) -> date:
    try:
        year, month = (int(p) for p in str(text).split("-"))
        return date(year, month, 1)
    except (TypeError, ValueError):
        raise InvalidInput(f"{text!r} is not a month like 2026-11.", field="month") from None


def invoices_generate(*, actor: Actor, month: date, organization=None) -> list[Invoice]:
    """Build (or rebuild) the draft invoice of each organization with usage in `month`.

    Idempotent: a draft is replaced line by line from the ledger; an issued invoice is never
    touched (asking for one organization whose invoice is issued is a Conflict). Each line is
    the sum of the usage records of one project and GPU model, and the total the sum of the
    lines, so the total equals the sum of the month's records exactly (amounts keep 6 decimals;
    rounding to cents is left to presentation and payment).
    """

    require_operator(actor, "Only site staff generate invoices.")
    start, end = month_bounds(month)
    records = UsageRecord.objects.filter(hour__gte=start, hour__lt=end)
    if organization is not None:
        records = records.filter(organization=organization)
        org_ids = [organization.pk]
    else:
        org_ids = sorted(set(records.values_list("organization_id", flat=True)))
    out = []
    for org_id in org_ids:
        with transaction.atomic():
            invoice, _ = Invoice.objects.select_for_update().get_or_create(
                organization_id=org_id, month=month,
                defaults={"generated_at": timezone.now(), "currency": settings.BILLING_CURRENCY})
            if invoice.status != InvoiceStatus.DRAFT:
                if organization is not None:
                    raise Conflict(f"The {month:%Y-%m} invoice of {organization.slug} is issued; it cannot change.")
                continue
            invoice.lines.all().delete()
            rows = records.filter(organization_id=org_id).values("project_id", "gpu_model").annotate(
                s=Sum("gpu_seconds"), a=Sum("amount")).order_by("project_id", "gpu_model")
            lines = [InvoiceLine(invoice=invoice, project_id=r["project_id"], gpu_model=r["gpu_model"],
                                 gpu_seconds=r["s"], amount=r["a"]) for r in rows]
            InvoiceLine.objects.bulk_create(lines)
            invoice.gpu_seconds = sum((line.gpu_seconds for line in lines), Decimal(0))
            invoice.total = sum((line.amount for line in lines), Decimal(0))
            invoice.generated_at = timezone.now()
            invoice.save(update_fields=["gpu_seconds", "total", "generated_at"])
            audit_record(actor=actor, action="invoice.generate", obj=invoice, month=f"{month:%Y-%m}",
                         total=str(invoice.total))
            out.append(invoice)
    return out


def invoice_issue(*, actor: Actor, invoice: Invoice) -> Invoice:
    """Freeze a draft: it is never regenerated again."""
    require_operator(actor, "Only site staff issue invoices.")
    with transaction.atomic():
        if not Invoice.objects.filter(pk=invoice.pk, status=InvoiceStatus.DRAFT).update(status=InvoiceStatus.ISSUED):
            raise Conflict("Only a draft invoice can be issued.")
        audit_record(actor=actor, action="invoice.issue", obj=invoice)
    invoice.refresh_from_db()
    return invoice


def ratecard_set(*, actor: Actor, gpu_model: str, price_per_gpu_hour: Decimal, effective_from: date,
                 qos_multipliers: dict | None = None, currency: str = "") -> RateCard:
    """Create or replace the card of a GPU model for a day (usage already metered keeps its price
    until it is metered again; closed allocations are never repriced)."""
    require_operator(actor, "Only site staff set prices.")
    if price_per_gpu_hour < 0:
        raise InvalidInput("Must be zero or more.", field="price_per_gpu_hour")
    for key, value in (qos_multipliers or {}).items():
        if key not in ("preemptible", "low", "normal", "high") or not isinstance(value, (int, float)) or value < 0:
            raise InvalidInput(f"{key!r}: use preemptible/low/normal/high with a number >= 0.", field="qos_multipliers")
    with transaction.atomic():
        card, _ = RateCard.objects.update_or_create(
            gpu_model=gpu_model, effective_from=effective_from,
            defaults={"price_per_gpu_hour": price_per_gpu_hour, "qos_multipliers": qos_multipliers or {},
                      "currency": currency or settings.BILLING_CURRENCY})
        audit_record(actor=actor, action="ratecard.set", obj=card, gpu_model=gpu_model,
                     price=str(price_per_gpu_hour), effective_from=str(effective_from))
    return card


def reconcile(*, allocation_ids=None, now: datetime | None = None) -> list[tuple[int, float, float]]:
    """[(allocation, allocated GPU-s, billed GPU-s)] where they differ by more than 1 s (the nightly
    reconciler of reliability notes 2.8; released allocations only, open ones move with `now`)."""

    qs = Allocation.objects.filter(released_at__isnull=False)
    if allocation_ids is not None:
        qs = qs.filter(pk__in=list(allocation_ids))
    billed = dict(UsageRecord.objects.filter(allocation__in=qs).values("allocation_id").annotate(
        s=Sum("gpu_seconds")).values_list("allocation_id", "s"))
    bad = []
    for pk, started, released, fraction in qs.values_list("pk", "started_at", "released_at", "fraction"):
        allocated = max(0.0, (released - started).total_seconds()) * float(fraction)
        got = float(billed.get(pk, 0))
        if abs(allocated - got) > 1.0:
            bad.append((pk, allocated, got))
    return bad

