from django.contrib import admin

from .models import Session, SessionPolicy


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = ("job", "name", "kind", "state", "share", "last_activity_at")
    list_filter = ("state", "kind")
    exclude = ("secret",)
    readonly_fields = ("job", "name", "kind", "port", "gateway_url", "running_at", "last_activity_at", "warned_at",
                       "ended_at")


@admin.register(SessionPolicy)
class SessionPolicyAdmin(admin.ModelAdmin):
    list_display = ("project", "idle_timeout_s", "max_lifetime_s")
