from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.core.context import ActorToken
from portal.tenancy.models import TenantQuerySet


class Scope(models.TextChoices):
    READ = "read", "Read projects, jobs, logs and usage"
    SUBMIT = "submit", "Submit, cancel and resubmit jobs"
    ADMIN = "admin", "Manage members, tokens and project settings"


class ApiTokenQuerySet(TenantQuerySet):
    def for_user(self, user, action: str = "view", *, project_id: int | None = None):
        """Tokens are personal: everyone, staff included, sees only their own."""
        if user is None or not user.is_authenticated:
            return self.none()
        qs = self.filter(user=user)
        if project_id is not None:
            qs = qs.filter(project_id=project_id)
        return qs

    def usable(self):
        now = timezone.now()
        return self.filter(revoked_at__isnull=True).filter(models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now))


class ApiToken(ActorToken, models.Model):
    """A personal API token. Only a SHA-256 digest of the secret is stored.

    The secret (`gpp_...`) is shown once at creation; `prefix` (its first 12
    characters) is kept to recognise it in lists and audit records.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, db_index=True)
    digest = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    project = models.ForeignKey(
        "tenancy.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="api_tokens",
        help_text="When set, the token sees and acts on this project only.",
    )
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children",
        help_text="The token this one was created with: it is never broader than it and dies with it.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def is_active(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes


class NotificationPreference(models.Model):
    """Which job events a person is emailed about (portal/jobs/notifications.py sends them).

    No row means the defaults: failures, preemption and idle flags on, success off (a
    person who submits hundreds of jobs wants to hear about the few that need them).
    """

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="notification_preference")
    job_succeeded = models.BooleanField(default=False)
    # failed, timeout, oom or node_fail
    job_failed = models.BooleanField(default=True)
    # preempted, or requeued because its GPU turned unhealthy or its node went silent
    job_preempted = models.BooleanField(default=True)
    job_idle = models.BooleanField(default=True)

    KINDS = ("succeeded", "failed", "preempted", "idle")

    def __str__(self) -> str:
        return f"notification preferences of {self.user}"

    def wants(self, kind: str) -> bool:
        return bool(getattr(self, f"job_{kind}", False))
