"""PostgreSQL advisory locks: one scheduling pass at a time, one metering run at a time (held
until the transaction ends, docs/design.md section 5), one autoscaler tick at a time (held by the
session, since a tick spans several transactions). Every key lives here, so two users of
one key cannot drift apart and two keys cannot collide.

On SQLite (the embedded default) they are no-ops: its IMMEDIATE transactions already
serialize writers.
"""
from contextlib import contextmanager

from django.db import connection

SCHEDULE_PASS = 0x67707531  # "gpu1": every scheduling pass, and a hold or update of a queued job
USAGE_METER = 0x62696C6C  # "bill": one metering run at a time
AUTOSCALE_TICK = 0x67707532  # "gpu2": held by the running autoscaler tick


def try_xact_lock(key: int) -> bool:
    """Take the lock if it is free, inside a transaction; False when another holder has it."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [key])
        return bool(cursor.fetchone()[0])


def xact_lock(key: int) -> None:
    """Inside a transaction: wait until the lock is free, then hold it until commit."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


@contextmanager
def session_lock(key: int):
    """Hold the lock for the block, across its transactions, if it is free: yields False (and
    holds nothing) when another session has it. Released when the block ends, whatever happens."""
    if connection.vendor != "postgresql":
        yield True
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        taken = bool(cursor.fetchone()[0])
    try:
        yield taken
    finally:
        if taken:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
