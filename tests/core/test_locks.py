"""portal/core/locks.py: the session lock that keeps one autoscaler tick at a time."""
import threading

import pytest
from django.db import connections

from portal.core import locks


@pytest.mark.django_db(transaction=True)
def test_a_session_lock_is_held_for_the_block_and_released_whatever_happens():
    held, release, seen = threading.Event(), threading.Event(), []

    def other_session():
        try:
            with locks.session_lock(locks.AUTOSCALE_TICK) as taken:
                seen.append(taken)
                held.set()
                assert release.wait(30)
        finally:
            connections.close_all()

    other = threading.Thread(target=other_session)
    other.start()
    try:
        assert held.wait(30) and seen == [True]
        with locks.session_lock(locks.AUTOSCALE_TICK) as taken:
            assert taken is False  # the other session has it
    finally:
        release.set()
        other.join(timeout=30)
    with pytest.raises(RuntimeError):
        with locks.session_lock(locks.AUTOSCALE_TICK) as taken:
            assert taken is True  # free once the other block ended
            raise RuntimeError("a tick that fails")
    with locks.session_lock(locks.AUTOSCALE_TICK) as taken:
        assert taken is True  # the failed block released it
