from django.contrib import admin

from .models import Allocation, Job, JobEvent, JobTemplate


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    readonly_fields = ("at", "attempt", "state", "terminal", "message")


class AllocationInline(admin.TabularInline):
    model = Allocation
    extra = 0
    can_delete = False
    readonly_fields = ("attempt", "gpu", "fraction", "shared", "borrowed", "started_at", "released_at")


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Read-mostly: state changes go through the services (cancel in the API or pages)."""

    list_display = ("id", "name", "project", "user", "state", "gpus", "node", "reason_code", "submitted_at")
    list_filter = ("state", "priority", "preemptible", "project__organization", "project")
    search_fields = ("id", "name", "user__username", "project__slug", "image")
    date_hierarchy = "submitted_at"
    list_select_related = ("project", "user", "node")
    readonly_fields = [f.name for f in Job._meta.fields]
    inlines = [JobEventInline, AllocationInline]

    def has_add_permission(self, request):
        return False


@admin.register(JobTemplate)
class JobTemplateAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "created_by", "created_at")
    list_filter = ("project",)
    search_fields = ("name", "project__slug")


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ("job", "attempt", "gpu", "fraction", "borrowed", "started_at", "released_at")
    list_filter = ("shared", "borrowed", "gpu__model")
    search_fields = ("job__id", "gpu__uuid", "gpu__node__name")
    list_select_related = ("job", "gpu__node")
    readonly_fields = [f.name for f in Allocation._meta.fields]
