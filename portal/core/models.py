from django.conf import settings
from django.db import models


class AuditEvent(models.Model):
    """One state-changing action: who did what to which object, when and from where.

    Rows are only ever inserted. `actor_label` keeps the name when the user is
    later deleted; `token_prefix` says which API token acted (never the secret).
    """

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_label = models.CharField(max_length=150)
    action = models.CharField(max_length=64, db_index=True)  # e.g. "token.create", "membership.update"
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64, blank=True)
    object_repr = models.CharField(max_length=200, blank=True)
    project = models.ForeignKey(
        "tenancy.Project", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    source_ip = models.GenericIPAddressField(null=True, blank=True)
    token_prefix = models.CharField(max_length=16, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.object_repr}"
