"""Interactive sessions (docs/sessions.md): one record per port a job publishes.

The portal proxies a running session at /sessions/<job id>/<name>/ (portal/interactive/proxy.py);
the agent reports where it can be reached (``gateway_url``) and when it answers.
"""
import hashlib
import hmac
import secrets

from django.conf import settings
from django.db import models

from portal.tenancy.models import TenantQuerySet


class SessionKind(models.TextChoices):
    JUPYTER = "jupyter", "JupyterLab"
    HTTP = "http", "HTTP app"
    TERMINAL = "terminal", "Terminal"


class SessionState(models.TextChoices):
    STARTING = "starting"  # the job is queued or starting, or the app does not answer yet
    RUNNING = "running"    # the agent reached the app
    IDLE = "idle"          # no traffic for the project's idle time: warned, stopped after the grace
    ENDED = "ended"        # the job ended (or was stopped for idleness or its maximum lifetime)


LIVE_STATES = (SessionState.STARTING, SessionState.RUNNING, SessionState.IDLE)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def attempt_secret(secret: str, attempt: int) -> str:
    """What one attempt of the job's app and its node are given: a key of its own per attempt, made from
    the session's secret (never sent anywhere). A node that ran an earlier attempt (a retry or a
    preemption moved the job) knows nothing that opens the new one."""
    return hmac.new(secret.encode(), f"gpuportal-session-attempt:{attempt}".encode(), hashlib.sha256).hexdigest()


def key_for(secret: str, attempt: int, legacy_key: str = "", legacy_attempt: int = 0) -> str:
    """An attempt's key: its own (attempt_secret), or, for the one attempt launched before per-attempt
    keys, the secret its node and app were given then."""
    if legacy_key and attempt == legacy_attempt:
        return legacy_key
    return attempt_secret(secret, attempt)


class SessionQuerySet(TenantQuerySet):
    project_path = "job__project"


class Session(models.Model):
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="sessions")
    name = models.CharField(max_length=32)
    port = models.PositiveIntegerField(null=True, blank=True)
    kind = models.CharField(max_length=10, choices=SessionKind.choices)
    state = models.CharField(max_length=10, choices=SessionState.choices, default=SessionState.STARTING)
    # Each attempt's key is made from it (attempt_secret): injected into the app (JupyterLab's token) and
    # sent by the proxy to the agent's gateway; a request to the node or the app without it is refused.
    # Never shown to anyone, never sent as it is.
    secret = models.CharField(max_length=64, default=new_secret)
    # Who besides the job's owner may connect: the job's project ("project"), or nobody ("owner").
    share = models.CharField(max_length=8, choices=[("owner", "owner"), ("project", "project")], default="owner")
    # And these people by name, whatever ``share`` says: members of the job's organization (checked again
    # at every connection, so one who leaves it loses the way in).
    shared_users = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="shared_sessions")
    gateway_url = models.CharField(max_length=300, blank=True)
    # The attempt whose node gave gateway_url: the proxy sends an attempt's key only to that attempt's node.
    gateway_attempt = models.PositiveIntegerField(default=0)
    # An attempt launched before per-attempt keys: its node and app hold the session's secret of then,
    # kept here as that attempt's key (migration 0004) while ``secret`` was replaced, so that attempt stays
    # reachable and the node that knows the old secret can make no later attempt's key.
    legacy_key = models.CharField(max_length=64, blank=True)
    legacy_attempt = models.PositiveIntegerField(default=0)
    message = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    running_at = models.DateTimeField(null=True, blank=True)
    last_activity_at = models.DateTimeField(null=True, blank=True)
    warned_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    objects = SessionQuerySet.as_manager()

    class Meta:
        ordering = ["job_id", "name"]
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="session_unique_job_name")]
        indexes = [models.Index(fields=["state"])]

    def __str__(self) -> str:
        return f"session {self.job_id}/{self.name}"

    @property
    def path(self) -> str:
        return f"/sessions/{self.job_id}/{self.name}/"

    def secret_for(self, attempt: int) -> str:
        return key_for(self.secret, attempt, self.legacy_key, self.legacy_attempt)


class SessionPolicy(models.Model):
    """A project's limits on its sessions (set in the admin); a project without one gets the settings'
    defaults (SESSION_IDLE_TIMEOUT_S, SESSION_MAX_LIFETIME_S)."""

    project = models.OneToOneField("tenancy.Project", on_delete=models.CASCADE, related_name="session_policy")
    idle_timeout_s = models.PositiveIntegerField(help_text="Stop a session's job after this long without traffic "
                                                           "(0: never).")
    max_lifetime_s = models.PositiveIntegerField(help_text="Stop a session's job this long after it started "
                                                           "(0: only its time limit).")

    def __str__(self) -> str:
        return f"session policy of {self.project}"
