from django.contrib import admin

from .models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Staff can see and revoke tokens, never read a secret (only its digest is stored)."""

    list_display = ("prefix", "name", "user", "project", "scopes", "expires_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at", "expires_at", "project")
    search_fields = ("prefix", "name", "user__username")
    readonly_fields = ("user", "name", "prefix", "digest", "scopes", "project", "parent", "created_at", "expires_at",
                       "last_used_at")
    fields = readonly_fields + ("revoked_at",)

    def has_add_permission(self, request):
        return False
