"""Email to a job's submitter when it ends, is preempted or is flagged idle.

Triggers: `states.transition()` for state changes (one place, every path through it) and
`portal.metrics.services.jobs_flag_idle()` for the idle flag. Both call notify_on_commit(), which queues the
`jobs.notify` task on the `default` queue once the change is committed. The task takes ids
and re-reads the job; NotificationSent's unique (job, attempt, kind) key makes a retried or
doubled task mail once. Array tasks are not mailed one by one: their parent is, when it ends.
"""
import threading
from contextlib import contextmanager

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import F
from django.urls import reverse

from portal.accounts.models import NotificationPreference
from portal.core.prepared import AnyOf, Prepared
from portal.core.queue import send

from .models import Job, JobState, NotificationSent

FAILED = frozenset({JobState.FAILED, JobState.TIMEOUT, JobState.OOM, JobState.NODE_FAIL})
# A running attempt taken away and requeued, by the scheduler or by the portal's health rules.
REQUEUE_REASONS = frozenset({"gpu_unhealthy", "node_fail"})


def notification_kind(to: str, reason_code: str = "") -> str | None:
    """The kind of email a transition to `to` may send (preferences decide), or None."""
    if to == JobState.SUCCEEDED:
        return "succeeded"
    if to in FAILED:
        return "failed"
    if to == JobState.PREEMPTED or (to == JobState.QUEUED and reason_code in REQUEUE_REASONS):
        return "preempted"
    return None


_batch = threading.local()


def notify_on_commit(job_id: int, attempt: int, kind: str) -> None:
    pending = getattr(_batch, "pending", None)
    if pending is not None:  # inside notifications_batched(): decided together when it ends
        transaction.on_commit(lambda: pending.append((job_id, attempt, kind)))
    else:
        transaction.on_commit(lambda: _publish([(job_id, attempt, kind)]))


@contextmanager
def notifications_batched():
    """Notifications committed inside the block are decided together once they are committed: one
    query for whether each submitter wants mail, not one per job (a batch of an agent's end
    reports). Each is added by its own on-commit callback, so one rolled back is never added, and
    the decision is the callback registered last (at once outside a transaction)."""
    _batch.pending = pending = []
    try:
        yield
    finally:
        _batch.pending = None
        transaction.on_commit(lambda: pending and _publish(pending))


def _publish(notes: list[tuple[int, int, str]]) -> None:
    wanted = mail_wanted_many(notes)
    for job_id, attempt, kind in notes:
        if (job_id, kind) in wanted:  # no task for the many ends nobody asked to hear about
            send("jobs.notify", args=[job_id, attempt, kind], queue="default")  # portal/jobs/tasks.py


def mail_wanted(job_id: int, kind: str) -> bool:
    """Whether the submitter has an address and wants this kind of email, in one query (the task
    asks again when it sends, as preferences may change meanwhile)."""
    return (job_id, kind) in mail_wanted_many([(job_id, 0, kind)])


# Compiled once (portal/core/prepared.py): every batch of end reports asks it, and building the
# ORM's two joins cost more CPU than running them.
_PREF_FIELDS = tuple(f"job_{kind}" for kind in NotificationPreference.KINDS)
_WANTED = Prepared(lambda ids: Job.objects.filter(AnyOf(F("pk"), ids)).values_list(
    "pk", "user__email", *(f"user__notification_preference__{f}" for f in _PREF_FIELDS)), ids=[])


def mail_wanted_many(notes: list[tuple[int, int, str]]) -> set[tuple[int, str]]:
    """The (job id, kind) pairs of `notes` whose submitter has an address and wants that kind of
    email, in one query whatever their number."""
    rows = {row[0]: row[1:] for row in _WANTED.rows(ids=sorted({job_id for job_id, _, _ in notes}))}
    wanted = set()
    for job_id, _, kind in notes:
        row = rows.get(job_id)
        if row is None or not row[0]:
            continue
        field = f"job_{kind}"
        wants = row[1 + _PREF_FIELDS.index(field)]  # None: no preferences saved, the defaults hold
        if NotificationPreference._meta.get_field(field).default if wants is None else wants:
            wanted.add((job_id, kind))
    return wanted


def job_notify(*, job_id: int, attempt: int, kind: str) -> bool:
    """Mail the submitter about (job, attempt, kind) unless they opted out or it was sent already.

    The NotificationSent row and the mail share one transaction: a failed send rolls the row
    back so a retry can send; a concurrent duplicate waits on the unique index and stops.
    Returns True when a mail went out.
    """
    job = Job.objects.select_related("user", "project").filter(pk=job_id).first()
    if job is None or not job.user.email:
        return False
    prefs = NotificationPreference.objects.filter(user=job.user).first() or NotificationPreference(user=job.user)
    if not prefs.wants(kind):
        return False
    subject, body = render(job, attempt, kind)
    try:
        with transaction.atomic():
            NotificationSent.objects.create(job=job, attempt=attempt, kind=kind)
            send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, [job.user.email])
    except IntegrityError:
        return False  # sent already
    return True


def render(job: Job, attempt: int, kind: str) -> tuple[str, str]:
    """Subject and plain-text body. Read when sending, so the body says where the job is now."""
    what = {
        "succeeded": "succeeded",
        "failed": f"ended {job.get_state_display().lower()}",
        "preempted": f"was stopped and requeued (attempt {attempt})",
        "idle": "is holding GPUs it does not use",
    }[kind]
    subject = f"[gpuportal] Job {job.pk} ({job.name}) {what}"
    lines = [f"Job {job.pk} ({job.name}) in project {job.project.slug} {what}.", ""]
    if job.reason_message:
        lines.append(job.reason_message)
    if kind == "idle":
        lines.append(f"Its GPUs stayed under {settings.GPU_IDLE_UTIL_PCT:g}% utilization for "
                     f"{settings.GPU_IDLE_MINUTES} minutes. Cancel it if it no longer needs them.")
    if job.exit_code is not None and kind in ("succeeded", "failed"):
        lines.append(f"Exit code: {job.exit_code}")
    lines.append(f"Now: {job.get_state_display()} (attempt {job.attempt}).")
    lines += ["", f"Details: {settings.PORTAL_URL}{reverse('jobs:detail', args=[job.pk])}",
              "", "Choose which emails you get: PATCH /api/v1/me/notifications/"]
    return subject, "\n".join(lines)
