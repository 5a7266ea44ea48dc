"""Reads for interactive sessions: who may connect, and the cards the pages show."""

from datetime import timedelta

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone

from portal.core.prepared import AnyOf, Prepared
from portal.jobs.models import TERMINAL, JobState
from portal.tenancy.models import Membership

from .models import LIVE_STATES, Session, SessionState, key_for


def session_for_connect(user, job_id, name: str, *, token=None) -> Session | None:
    """The session a person may connect to, or None (the caller answers 404 either way).

    The job's owner, and the members of its project once the owner shares it with the project.
    Site staff get no way in to other people's apps. A token must carry the submit scope and, if
    restricted to a project, be that job's project."""
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    try:
        job_id = int(job_id)
    except (TypeError, ValueError):
        return None
    session = (Session.objects.filter(job_id=job_id, name=name).select_related("job__project").first())
    if session is None:
        return None
    if token is not None:
        if "submit" not in (token.scopes or []):
            return None
        if token.project_id is not None and token.project_id != session.job.project_id:
            return None
    if session.job.user_id == user.pk:
        return session
    if session.share == "project" and Session.objects.for_user(user, "view").filter(pk=session.pk).exists():
        return session
    if session.shared_users.filter(pk=user.pk).exists() and in_organization(user, session.job.project):
        return session
    return None


def in_organization(user, project) -> bool:
    """Whether a person is a member of a project of ``project``'s organization (the tenant)."""
    return Membership.objects.filter(user=user, project__organization_id=project.organization_id).exists()


def named_for_user(user):
    """Sessions shared with a person by name, in the organizations they are a member of."""
    orgs = Membership.objects.filter(user=user).values("project__organization_id")
    return Session.objects.filter(shared_users=user, job__project__organization_id__in=orgs)


def display_state(session: Session) -> str:
    """What a card says: the job's end ends its sessions whatever the agent last said."""
    if session.job.state in TERMINAL:
        return SessionState.ENDED
    if session.job.state != JobState.RUNNING:
        return SessionState.STARTING
    return session.state


def sessions_for_user(user, *, job=None, live_only: bool = False):
    """Sessions a person may connect to (their own, and those shared with their projects)."""
    mine = Session.objects.for_user(user, "view").filter(Q(job__user=user) | Q(share="project"))
    qs = Session.objects.filter(Q(pk__in=mine.values("pk")) | Q(pk__in=named_for_user(user).values("pk"))) \
        .select_related("job", "job__project").order_by("-job__submitted_at", "name")
    if job is not None:
        qs = qs.filter(job=job)
    if live_only:
        qs = qs.filter(state__in=LIVE_STATES).exclude(job__state__in=_terminal())
    return qs


def _terminal():
    return list(TERMINAL)


# Compiled once per process: every pass that starts jobs reads their sessions.
_LAUNCH_SESSIONS = Prepared(lambda ids: Session.objects.filter(AnyOf(F("job_id"), ids)).order_by("job_id", "name")
                            .values_list("job_id", "name", "port", "kind", "secret", "job__attempt", "legacy_key",
                                         "legacy_attempt"), ids=[])


def launch_sessions(job_ids: list[int]) -> dict[int, list[dict]]:
    """What the agent needs to publish each job's sessions, in one query for any number of jobs."""
    out: dict[int, list[dict]] = {}
    if not job_ids:
        return out
    for job_id, name, port, kind, secret, attempt, legacy_key, legacy_attempt in _LAUNCH_SESSIONS.rows(ids=list(job_ids)):
        out.setdefault(job_id, []).append({"name": name, "port": port, "kind": kind,
                                           # this attempt's own
                                           "secret": key_for(secret, attempt, legacy_key, legacy_attempt),
                                           "base_url": f"/sessions/{job_id}/{name}/"})
    return out


def session_cards(user, limit: int = 12) -> list[Session]:
    """The dashboard's cards: live sessions a person may connect to, with what a card shows."""
    return _annotate(user, list(sessions_for_user(user, live_only=True).select_related("job__user")
                                .prefetch_related("shared_users")[:limit]))


def job_session_cards(user, job) -> list[Session]:
    """The job page's cards: that job's sessions a person may connect to, ended ones too."""
    return _annotate(user, list(sessions_for_user(user, job=job).select_related("job__user")
                                .prefetch_related("shared_users")))


def _annotate(user, cards: list[Session]) -> list[Session]:
    """What a card shows besides the session's own fields."""
    now = timezone.now()
    for s in cards:
        s.shared_names = sorted(u.username for u in s.shared_users.all())
        s.shared_with_me = s.job.user_id != user.pk
        s.shown_state = display_state(s)
        last = s.last_activity_at or s.running_at or s.created_at
        s.idle_minutes = max(0, int((now - last).total_seconds() // 60))
        # When the culler stops it unless it is used (the warning email says the same).
        s.stops_at = s.warned_at + timedelta(seconds=settings.SESSION_IDLE_GRACE_S) if s.warned_at else None
    return cards
