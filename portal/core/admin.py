from django.contrib import admin

from .models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Read-only: the audit log is evidence, nobody edits it."""

    list_display = ("created_at", "actor_label", "action", "object_type", "object_repr", "source_ip", "token_prefix")
    list_filter = ("action", "object_type", "created_at")
    search_fields = ("actor_label", "object_repr", "object_id", "token_prefix", "source_ip")
    date_hierarchy = "created_at"
    readonly_fields = [f.name for f in AuditEvent._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
