"""Writes for interactive sessions (docs/sessions.md): create at submit, agent reports, sharing,
activity, idle culling."""
import logging
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from portal.core.context import Actor
from portal.core.errors import Forbidden, InvalidInput
from portal.core.services import audit_record
from portal.jobs.models import TERMINAL, JobState
from portal.jobs.services import job_cancel

from .models import LIVE_STATES, Session, SessionPolicy, SessionState
from .notifications import idle_warning_send
from .selectors import in_organization

log = logging.getLogger(__name__)

# The proxy writes a session's last activity at most this often (one UPDATE per session and period).
ACTIVITY_WRITE_S = 30


def sessions_create(job, ports: list[dict]) -> list[Session]:
    """One Session per published port, each with its own secret."""
    return Session.objects.bulk_create([
        Session(job=job, name=p["name"], port=p.get("port"), kind=p["kind"]) for p in ports])


def job_sessions_create(job, spec: dict) -> None:
    """A new job's published ports become its sessions: run inside job_submit's transaction
    (registered in portal/interactive/apps.py with portal/jobs/submit_hooks.py)."""
    if spec.get("ports"):
        sessions_create(job, spec["ports"])


def session_report(*, node, job, attempt: int, name: str, state: str, gateway_url: str = "",
                   message: str = "") -> Session | None:
    """The agent on the job's node says a session is reachable (``running``) or gone (``ended``).
    None when the job holds no such session; a report for an old attempt changes nothing."""
    session = Session.objects.filter(job=job, name=name).first()
    if session is None or attempt != job.attempt:
        return None
    now = timezone.now()
    fields = {"state": state, "message": message[:300]}
    if state == SessionState.RUNNING:
        fields.update(gateway_url=gateway_url, gateway_attempt=attempt, running_at=now, last_activity_at=now,
                      warned_at=None, ended_at=None)
    elif state == SessionState.ENDED:
        fields.update(ended_at=now, gateway_url="")
    Session.objects.filter(pk=session.pk).update(**fields)
    session.refresh_from_db()
    return session


def session_share(*, actor: Actor, session: Session, share: str | None = None,
                  users: list[str] | None = None) -> Session:
    """Only the job's owner says who else may connect: nobody ("owner") or the job's project, and
    people by name (``users`` replaces the list): members of the job's organization only."""
    if session.job.user_id != getattr(actor.user, "pk", None):
        raise Forbidden("Only the job's owner can share its sessions.")
    people = []
    if users is not None:
        found = {u.username: u for u in get_user_model().objects.filter(username__in=users, is_active=True)}
        # One answer for an unknown name and another tenant's user: names of other tenants never leak.
        missing = [n for n in users if n not in found or not in_organization(found[n], session.job.project)]
        if missing:
            raise InvalidInput("No user named " + ", ".join(repr(n) for n in missing) + " in this job's organization.",
                               field="users")
        people = [found[n] for n in dict.fromkeys(users) if found[n].pk != session.job.user_id]
    with transaction.atomic():
        if share is not None:
            Session.objects.filter(pk=session.pk).update(share=share)
            session.share = share
        if users is not None:
            session.shared_users.set(people)
        audit_record(actor=actor, action="session.share", obj=session, project=session.job.project,
                     share=session.share, users=sorted(u.username for u in session.shared_users.all()))
    return session


def session_touch(session_id: int, last_written) -> bool:
    """Record proxied traffic (at most every ACTIVITY_WRITE_S). Returns whether it wrote."""
    now = timezone.now()
    if last_written is not None and (now - last_written).total_seconds() < ACTIVITY_WRITE_S:
        return False
    # Traffic brings an idle (warned) session back to running.
    Session.objects.filter(pk=session_id, state__in=LIVE_STATES).exclude(state=SessionState.STARTING).update(
        last_activity_at=now, state=SessionState.RUNNING, warned_at=None)
    return True


def policy_for(project) -> tuple[int, int]:
    """(idle timeout, maximum lifetime) in seconds for a project's sessions; 0 means none."""
    policy = SessionPolicy.objects.filter(project=project).first()
    if policy is None:
        return settings.SESSION_IDLE_TIMEOUT_S, settings.SESSION_MAX_LIFETIME_S
    return policy.idle_timeout_s, policy.max_lifetime_s


def sessions_cull(now=None) -> dict[str, int]:
    """Warn sessions idle past their project's idle time (no proxied traffic, and the job's GPUs idle
    by the idle detector's reading of NVML, Job.idle_since) (state idle), stop the jobs of those still
    idle after SESSION_IDLE_GRACE_S, and of those past their maximum lifetime; mark the sessions of
    ended jobs ended. Runs from beat (portal/interactive/tasks.py)."""
    now = now or timezone.now()
    counts = {"ended": 0, "warned": 0, "stopped": 0, "mailed": 0}
    counts["ended"] = Session.objects.filter(state__in=LIVE_STATES, job__state__in=TERMINAL).update(
        state=SessionState.ENDED, ended_at=now, gateway_url="")
    live = (Session.objects.filter(state__in=(SessionState.RUNNING, SessionState.IDLE), job__state=JobState.RUNNING)
            .select_related("job__project", "job__user"))
    policies: dict[int, tuple[int, int]] = {}
    stop: dict[int, tuple[object, str]] = {}
    warned: dict[int, tuple[int, list[Session]]] = {}  # job -> (idle time, the sessions warned now)
    grace = timedelta(seconds=settings.SESSION_IDLE_GRACE_S)
    for s in live:
        idle_s, life_s = policies.setdefault(s.job.project_id, policy_for(s.job.project))
        started = s.running_at or s.created_at
        if life_s and now - started >= timedelta(seconds=life_s):
            stop[s.job_id] = (s.job, f"Session {s.name} reached the project's maximum lifetime of {life_s} s.")
            continue
        last = s.last_activity_at or started
        if not idle_s or now - last < timedelta(seconds=idle_s):
            continue
        if s.job.gpus > 0 and s.job.idle_since is None:
            continue  # its GPUs work (the idle detector reads NVML's utilization): a computation runs
        if s.state == SessionState.RUNNING:
            # Conditional: of concurrent culler ticks, one warns (and mails) each idle period.
            if Session.objects.filter(pk=s.pk, state=SessionState.RUNNING).update(state=SessionState.IDLE,
                                                                                  warned_at=now):
                warned.setdefault(s.job_id, (idle_s, []))[1].append(s)
                counts["warned"] += 1
            log.info("session %s/%s idle for %s s: warned", s.job_id, s.name, idle_s)
        elif s.warned_at is not None and now - s.warned_at >= grace:
            stop[s.job_id] = (s.job, f"Session {s.name} was idle for {idle_s} s; its GPUs were released.")
    for idle_s, sessions in warned.values():
        counts["mailed"] += idle_warning_send(sessions, idle_s=idle_s, warned_at=now)
    for job, reason in stop.values():
        try:
            job_cancel(actor=Actor(user=None, label="session-culler"), job=job, reason=reason)
        except Exception as exc:  # ended meanwhile: nothing to stop
            log.info("session culler: job %s not stopped: %s", job.pk, exc)
            continue
        counts["stopped"] += 1
    return counts
