"""Coalesced scheduling passes: a burst of submits and job ends asks for a handful of passes, not one each.

A request sets the shared flag `scheduler:pass-requested` (Redis SET NX through the cache) and
publishes the pass task only when the flag was not set already: while a pass is requested and
has not begun, further requests add nothing to the queue. The pass clears the flag once it holds
the scheduling lock, before it reads anything (`pass_begins`), so a request committed before
that is in its snapshot, and one after it publishes the next pass. Consecutive passes start at
least SCHEDULER_PASS_INTERVAL_S apart (Slurm's sched_min_interval): the task is published with
the countdown that is left.

Only a cache shared by every process (Redis) can carry the flag; without one (the embedded
mode's per-process memory cache), or while Redis is unreachable, every request publishes, as
before. A flag whose pass was lost expires after FLAG_TTL_S, and beat's pass clears it anyway.
"""
import time

from django.conf import settings
from django.core.cache import cache

FLAG = "scheduler:pass-requested"
LAST_START = "scheduler:pass-started-at"
FLAG_TTL_S = 60


def shared_cache() -> bool:
    return "Redis" in settings.CACHES["default"]["BACKEND"]


def pass_request() -> float | None:
    """Whether to publish a pass now: None when one is already requested and not yet begun, else
    the countdown (seconds) that keeps passes SCHEDULER_PASS_INTERVAL_S apart."""
    if not shared_cache():
        return 0.0
    # One round trip (a submit's): the flag set if unset, and when the last pass started. While Redis
    # is down it answers "set, no last start": publish now.
    added, last = cache.flag_and_get(FLAG, FLAG_TTL_S, LAST_START)
    if not added:
        return None
    return max(0.0, last + settings.SCHEDULER_PASS_INTERVAL_S - time.time()) if last else 0.0


def pass_request_failed() -> None:
    """The task could not be published: let the next request try."""
    if shared_cache():
        cache.delete(FLAG)


def pass_begins() -> None:
    """Called by a pass holding the scheduling lock, before its snapshot."""
    if shared_cache():
        cache.set_many({LAST_START: time.time()}, timeout=FLAG_TTL_S)
        cache.delete(FLAG)
