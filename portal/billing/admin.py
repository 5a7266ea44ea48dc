from django.contrib import admin

from .models import BudgetAlert, Invoice, InvoiceLine, RateCard, UsageRecord


@admin.register(RateCard)
class RateCardAdmin(admin.ModelAdmin):
    list_display = ("gpu_model", "price_per_gpu_hour", "currency", "effective_from", "qos_multipliers")
    list_filter = ("gpu_model",)


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """The ledger is written by metering only."""

    list_display = ("hour", "organization", "project", "job_id", "gpu_model", "fraction", "gpu_seconds", "amount",
                    "final")
    list_filter = ("final", "gpu_model", "organization")
    list_select_related = ("organization", "project")
    date_hierarchy = "hour"
    readonly_fields = [f.name for f in UsageRecord._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    readonly_fields = ("project", "gpu_model", "gpu_seconds", "amount")


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ("month", "organization", "status", "total", "currency", "generated_at")
    list_filter = ("status", "month")
    readonly_fields = ("organization", "month", "gpu_seconds", "total", "generated_at", "currency")
    inlines = [InvoiceLineInline]


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin):
    list_display = ("project", "month", "level", "used_gpu_hours", "budget_gpu_hours", "created_at")
