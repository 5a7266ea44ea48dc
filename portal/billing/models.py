"""Billing: rate cards, the usage ledger metered from allocations, invoices, budget alerts.

The ledger is `UsageRecord`: one row per (allocation, UTC hour) with a unique key, holding
the *total* GPU-seconds the allocation covered in that hour. Metering upserts totals, never
adds deltas, so a retried or duplicated metering run is a no-op (reliability notes 2.8).
"""
from decimal import Decimal

from django.conf import settings
from django.db import models

from portal.tenancy.models import Membership, Project, Role, TenantQuerySet, staff_bypass


class RateCard(models.Model):
    """The price of one GPU-hour of a GPU model from a date on; the latest effective card applies.

    `gpu_model` "*" is the fallback for models without a card of their own. `qos_multipliers`
    scale the price: "preemptible" applies to preemptible jobs, otherwise the job's priority
    ("low", "normal", "high"); a missing key means 1.
    """

    gpu_model = models.CharField(max_length=64)
    price_per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    currency = models.CharField(max_length=3, default="USD")
    effective_from = models.DateField()
    qos_multipliers = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["gpu_model", "-effective_from"]
        constraints = [models.UniqueConstraint(fields=["gpu_model", "effective_from"], name="ratecard_unique_day")]

    def __str__(self) -> str:
        return f"{self.gpu_model} {self.price_per_gpu_hour} {self.currency}/GPU-h from {self.effective_from}"

    def multiplier(self, *, preemptible: bool, priority: str) -> Decimal:
        key = "preemptible" if preemptible else priority
        return Decimal(str(self.qos_multipliers.get(key, 1)))


class UsageRecordQuerySet(TenantQuerySet):
    project_path = "project"


class UsageRecord(models.Model):
    """GPU-seconds one allocation covered in one UTC hour, and what they cost.

    Project, organization, user, GPU model and QoS are copied from the job so reports and
    invoices never join back through jobs that may change. `final` is set once the
    allocation is released: the row will not change again.
    """

    allocation = models.ForeignKey("jobs.Allocation", on_delete=models.PROTECT, related_name="usage_records")
    hour = models.DateTimeField()  # start of the UTC hour
    project = models.ForeignKey("tenancy.Project", on_delete=models.PROTECT, related_name="usage_records")
    organization = models.ForeignKey("tenancy.Organization", on_delete=models.PROTECT, related_name="usage_records")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    job_id = models.BigIntegerField()
    gpu_model = models.CharField(max_length=64)
    fraction = models.DecimalField(max_digits=4, decimal_places=3)
    preemptible = models.BooleanField(default=False)
    priority = models.CharField(max_length=8)
    gpu_seconds = models.DecimalField(max_digits=14, decimal_places=3)
    unit_price = models.DecimalField(max_digits=12, decimal_places=4)  # per GPU-hour, multiplier applied
    currency = models.CharField(max_length=3, default="USD")
    amount = models.DecimalField(max_digits=16, decimal_places=6)
    final = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    objects = UsageRecordQuerySet.as_manager()

    class Meta:
        ordering = ["hour", "id"]
        constraints = [
            # The ledger's idempotency key: a retried metering run can never bill an hour twice.
            models.UniqueConstraint(fields=["allocation", "hour"], name="usagerecord_unique_allocation_hour"),
        ]
        indexes = [models.Index(fields=["organization", "hour"]), models.Index(fields=["project", "hour"]),
                   models.Index(fields=["hour"])]  # UsageDay rebuilds read recent hours of every project


class UsageDay(models.Model):
    """The ledger summed per project and UTC day: what the console's revenue charts read.

    Rebuilt by usage_meter, in its transaction, for every day from the earliest hour that run
    rewrote, so it always equals the sum of its UsageRecords; reading a month is ~31 rows per
    project instead of one per allocation and hour. Invoices and budgets still read the ledger.
    """

    day = models.DateField()
    project = models.ForeignKey("tenancy.Project", on_delete=models.PROTECT, related_name="+")
    organization = models.ForeignKey("tenancy.Organization", on_delete=models.PROTECT, related_name="+")
    gpu_seconds = models.DecimalField(max_digits=18, decimal_places=3)
    amount = models.DecimalField(max_digits=18, decimal_places=6)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["day", "project"], name="usageday_unique_project_day")]


class AllocationMeter(models.Model):
    """How far metering has got with one allocation; `closed` once it was metered after release."""

    allocation = models.OneToOneField("jobs.Allocation", on_delete=models.PROTECT, primary_key=True,
                                      related_name="meter")
    metered_until = models.DateTimeField()
    closed = models.BooleanField(default=False, db_index=True)


class InvoiceStatus(models.TextChoices):
    DRAFT = "draft", "Draft"  # regenerated freely until issued
    ISSUED = "issued", "Issued"  # sent to the customer: never regenerated


class InvoiceQuerySet(models.QuerySet):
    def for_user(self, user, action: str = "view", *, project_id: int | None = None):
        """Staff see every invoice; an owner of any project of an organization sees its invoices."""
        if user is None or not user.is_authenticated or not user.is_active:
            return self.none()
        qs = self
        if not staff_bypass(user, action):
            owned = Membership.objects.filter(user=user, role=Role.OWNER)
            if project_id is not None:
                owned = owned.filter(project_id=project_id)
            qs = qs.filter(organization__in=Project.objects.filter(pk__in=owned.values("project")).values(
                "organization"))
        elif project_id is not None:
            qs = qs.filter(organization__in=Project.objects.filter(pk=project_id).values("organization"))
        return qs


class Invoice(models.Model):
    """One organization's bill for one calendar month (UTC); totals equal the sum of its usage records."""

    organization = models.ForeignKey("tenancy.Organization", on_delete=models.PROTECT, related_name="invoices")
    month = models.DateField()  # first day of the month
    status = models.CharField(max_length=8, choices=InvoiceStatus.choices, default=InvoiceStatus.DRAFT)
    currency = models.CharField(max_length=3, default="USD")
    gpu_seconds = models.DecimalField(max_digits=18, decimal_places=3, default=0)
    total = models.DecimalField(max_digits=18, decimal_places=6, default=0)
    generated_at = models.DateTimeField()

    objects = InvoiceQuerySet.as_manager()

    class Meta:
        ordering = ["-month", "organization__slug"]
        constraints = [models.UniqueConstraint(fields=["organization", "month"], name="invoice_one_per_org_month")]

    def __str__(self) -> str:
        return f"invoice {self.organization.slug} {self.month:%Y-%m}"

    @property
    def number(self) -> str:
        return f"{self.month:%Y%m}-{self.organization_id:05d}"


class InvoiceLine(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    project = models.ForeignKey("tenancy.Project", on_delete=models.PROTECT, related_name="+")
    gpu_model = models.CharField(max_length=64)
    gpu_seconds = models.DecimalField(max_digits=18, decimal_places=3)
    amount = models.DecimalField(max_digits=18, decimal_places=6)

    class Meta:
        ordering = ["project__slug", "gpu_model"]

    @property
    def gpu_hours(self) -> Decimal:
        return (self.gpu_seconds / 3600).quantize(Decimal("0.001"))


class BudgetAlert(models.Model):
    """A project crossed a share of its monthly GPU-hour budget; one row per level and month."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="budget_alerts")
    month = models.DateField()
    level = models.PositiveSmallIntegerField()  # percent: 80 (warning) or 100 (spent)
    used_gpu_hours = models.DecimalField(max_digits=14, decimal_places=3)
    budget_gpu_hours = models.DecimalField(max_digits=12, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["project", "month", "level"], name="budgetalert_once")]
