"""Coalesced scheduling passes: a burst of submits and job ends asks for a handful of passes, not one each.

A request sets the shared flag `scheduler:pass-requested` (Redis SET NX through the cache) to
"<when> <task id>" and publishes the pass task, with that id, only when the flag was not set
already: while a pass is requested and has not begun, further requests add nothing to the queue.
That pass clears the flag once it holds the scheduling lock, before it reads anything
(`pass_begins`), so a request committed before that is in its snapshot, and one after it
publishes the next pass. Consecutive passes start at least SCHEDULER_PASS_INTERVAL_S apart
(Slurm's sched_min_interval): the task is published with the countdown that is left.

Only the requested pass clears the flag. Beat's pass, or any other (a direct call, a pass queued
for later by a requeue), leaves it to the pass it names: were every pass to clear it, each one
not requested would let the next request queue a second task while the requested one still
waited, and the two would go on re-queueing each other (every beat pass added another: passes
ran ever more often than the interval, 20 a second after 20 s of submits). A flag older than
STALE_S, whose pass was lost, is cleared by whichever pass comes next (beat's within 5 s), and
expires after FLAG_TTL_S in any case.

Only a cache shared by every process (Redis) can carry the flag; without one (the embedded
mode's per-process memory cache), or while Redis is unreachable, every request publishes, as
before.
"""
import time
import uuid

from django.conf import settings
from django.core.cache import cache

FLAG = "scheduler:pass-requested"
# A plain number (the epoch seconds), read and written outside the cache's serializer. The key
# before the flag named its task held the serializer's pickled float; a portal of either version
# reads only its own key, so neither meets the other's form during an upgrade.
LAST_START = "scheduler:pass-started"
FLAG_TTL_S = 60
STALE_S = 10.0  # a requested pass not begun by then was lost: any pass clears its flag


def shared_cache() -> bool:
    return "Redis" in settings.CACHES["default"]["BACKEND"]


def pass_request() -> tuple[float, str | None] | None:
    """Whether to publish a pass now: None when one is already requested and not yet begun, else
    (the countdown in seconds that keeps passes SCHEDULER_PASS_INTERVAL_S apart, the id to publish
    the task with; None: any)."""
    if not shared_cache():
        return 0.0, None
    task_id, now = str(uuid.uuid4()), time.time()
    # One round trip (a submit's): the flag set if unset, and when the last pass started. While Redis
    # is down it answers "set, no last start": publish now.
    added, last = cache.flag_and_get(FLAG, FLAG_TTL_S, LAST_START, f"{now!r} {task_id}")
    if not added:
        return None
    try:
        last = float(last) if last else None
    except ValueError:  # not a number (written by hand?): as if none
        last = None
    return (max(0.0, last + settings.SCHEDULER_PASS_INTERVAL_S - now) if last else 0.0), task_id


def pass_request_failed() -> None:
    """The task could not be published: let the next request try."""
    if shared_cache():
        cache.delete(FLAG)


def pass_begins(task_id: str | None = None) -> None:
    """Called by a pass holding the scheduling lock, before its snapshot; `task_id`: its task's id
    (None for a direct call). Notes when it started, and clears the flag if this is the pass it
    requested, or the flag is stale (one round trip)."""
    if shared_cache():
        now = time.time()
        cache.flag_clear(FLAG, task_id or "", now - STALE_S, LAST_START, repr(now), FLAG_TTL_S)
