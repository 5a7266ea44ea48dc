from datetime import datetime, timezone as dt_timezone

import pytest


@pytest.fixture
def clock(clock, request):
    """The pinned clock (tests/clock.py) at 09:40 on 3 November, where the scenarios of this folder
    count their hours from; tests marked clock (test_month_boundary.py) keep their instant."""
    if request.node.get_closest_marker("clock") is None:
        clock.move_to(datetime(2026, 11, 3, 9, 40, 0, tzinfo=dt_timezone.utc))
    return clock
