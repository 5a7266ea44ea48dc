"""Queueing a task by its name: a lower layer asks for work that a higher one defines without
importing it (docs/design.md section 2). Jobs, nodes and metrics ask for a scheduling pass;
job states ask for a notification.

Publishing is best effort and never fails the caller: a lost pass is run by beat within seconds,
and a task that must not be lost is queued from the transaction that needs it (on commit).
"""
import logging

from django.db import transaction

from portal.celery import app
from portal.core import passes

log = logging.getLogger(__name__)

SCHEDULE_PASS = "scheduler.schedule_pass"  # scheduler/tasks.py


def send(name: str, *, args=(), queue: str, countdown: float = 0.0, task_id: str | None = None) -> bool:
    """Publish the task `name` (to run after `countdown` seconds; with this id, else a new one);
    False (and a warning) when the broker cannot be reached."""
    try:
        # No retries: a broker hiccup must not hang or fail the request that asked.
        app.send_task(name, args=list(args), queue=queue, retry=False, countdown=countdown or None, task_id=task_id)
    except Exception as exc:  # kombu raises several types for an unreachable broker
        log.warning("could not queue %s%s: %s", name, list(args), exc)
        return False
    return True


def request_schedule_pass() -> None:
    """Ask for a scheduling pass once the current transaction commits (beat also runs one)."""
    transaction.on_commit(_publish_schedule_pass)


def _publish_schedule_pass() -> None:
    # Coalesced: nothing is queued while a requested pass has not begun (portal/core/passes.py).
    wanted = passes.pass_request()
    if wanted is not None and not send(SCHEDULE_PASS, queue="scheduler", countdown=wanted[0], task_id=wanted[1]):
        passes.pass_request_failed()
