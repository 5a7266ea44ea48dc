from datetime import datetime, timezone as dt_timezone

import pytest

from portal.core.context import Actor
from portal.jobs.services import job_submit

IMAGE = "gpuportal/busybox:latest"


@pytest.fixture
def clock(clock, request):
    """The pinned clock (tests/clock.py) at 09:40 on 3 November, where the scenarios of this folder
    count their hours from; tests marked clock (test_month_boundary.py) keep their instant."""
    if request.node.get_closest_marker("clock") is None:
        clock.move_to(datetime(2026, 11, 3, 9, 40, 0, tzinfo=dt_timezone.utc))
    return clock


@pytest.fixture
def sent(monkeypatch):
    calls = []
    monkeypatch.setattr("scheduler.dispatch._send", lambda task, node, args: calls.append((task, node, args)))
    return calls


def submit(demo, user="alice", project="vision", **over):
    data = {"project": project, "name": "j", "image": IMAGE, "command": ["true"], **over}
    job, _ = job_submit(actor=Actor(user=demo.users[user]), data=data)
    return job
