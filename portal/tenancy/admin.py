from django.contrib import admin

from .models import Membership, Organization, Project, Quota


class ProjectInline(admin.TabularInline):
    model = Project
    fields = ("slug", "name")
    extra = 0
    show_change_link = True


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "max_gpus", "created_at")
    search_fields = ("slug", "name")
    inlines = [ProjectInline]


class QuotaInline(admin.StackedInline):
    model = Quota
    can_delete = False


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ("user",)
    readonly_fields = ("user", "role")
    can_delete = False
    # Roles are changed through the API or pages so guardian permissions and the audit log follow.
    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "organization", "created_at")
    list_filter = ("organization",)
    search_fields = ("slug", "name", "organization__slug")
    inlines = [QuotaInline, MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("project", "user", "role", "created_at")
    list_filter = ("role", "project__organization", "project")
    search_fields = ("user__username", "project__slug")
    readonly_fields = ("project", "user", "role", "created_at")

    def has_add_permission(self, request):
        return False


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ("project", "guaranteed_gpus", "max_gpus", "max_running_jobs", "gpu_hours_budget",
                    "budget_hard_stop", "network_allowed")
    list_filter = ("network_allowed", "budget_hard_stop", "project__organization")
    search_fields = ("project__slug",)
