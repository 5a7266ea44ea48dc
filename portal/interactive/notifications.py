"""Email to a session's owner when it turns idle: when it will be stopped and how to keep it.

Sent by the culler (services.sessions_cull) at the moment it warns a session: the warning is one
conditional UPDATE from running to idle, so one culler tick, and one only, mails each idle period;
traffic brings the session back to running, and a later idle period mails again. The owner's
``job_idle`` preference (the one the idle-GPU email uses, PATCH /api/v1/me/notifications/) decides.
A failed send is logged and never stops the culling.
"""
import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.core.mail import send_mail

from portal.accounts.models import NotificationPreference

from .models import Session

log = logging.getLogger(__name__)


def idle_mail_wanted(user) -> bool:
    if not user.email:
        return False
    prefs = NotificationPreference.objects.filter(user=user).first() or NotificationPreference(user=user)
    return prefs.wants("idle")


def idle_warning_render(sessions: list[Session], *, idle_s: int, stop_at: datetime) -> tuple[str, str]:
    """Subject and plain-text body of the warning for one job's sessions warned together."""
    job = sessions[0].job
    names = ", ".join(s.name for s in sessions)
    minutes = max(1, round(idle_s / 60))
    grace_min = max(1, round(settings.SESSION_IDLE_GRACE_S / 60))
    subject = (f"[gpuportal] Session {names} of job {job.pk} ({job.name}) is idle: "
               f"it stops at {stop_at:%H:%M} UTC")
    lines = [
        f"Your session{'s' if len(sessions) > 1 else ''} {names} of job {job.pk} ({job.name}) in project "
        f"{job.project.slug} had no traffic for {minutes} minutes" + (" and its GPUs are idle." if job.gpus else "."),
        "",
        f"It will be stopped at {stop_at:%Y-%m-%d %H:%M} UTC (in {grace_min} minutes): its job is cancelled "
        "and its GPUs released.",
        "",
        "To keep it, use it: open it (or type in its terminal, run a cell); any traffic brings it back to running.",
    ]
    lines += [f"  {s.name} ({s.get_kind_display()}): {settings.PORTAL_URL}{s.path}" for s in sessions]
    lines += ["", "Choose which emails you get: PATCH /api/v1/me/notifications/ (job_idle)"]
    return subject, "\n".join(lines)


def idle_warning_send(sessions: list[Session], *, idle_s: int, warned_at: datetime) -> bool:
    """Mail the owner of a job whose sessions the culler has just warned. True when a mail went out."""
    job = sessions[0].job
    if not idle_mail_wanted(job.user):
        return False
    stop_at = warned_at + timedelta(seconds=settings.SESSION_IDLE_GRACE_S)
    subject, body = idle_warning_render(sessions, idle_s=idle_s, stop_at=stop_at)
    try:
        send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, [job.user.email])
    except Exception as exc:  # SMTP down: the card still shows the warning; culling goes on
        log.warning("job %s: idle sessions' warning not mailed: %s", job.pk, exc)
        return False
    return True
