from datetime import datetime, timedelta, timezone as dt_timezone

import pytest

from portal.core.context import Actor
from portal.jobs.services import job_submit

IMAGE = "gpuportal/busybox:latest"


class Clock:
    """A settable wall clock behind django.utils.timezone.now (transitions, auto_now, metering)."""

    def __init__(self, start: datetime):
        self.t = start

    def __call__(self) -> datetime:
        return self.t

    def advance(self, **kw) -> datetime:
        self.t += timedelta(**kw)
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock(datetime(2026, 11, 3, 9, 40, 0, tzinfo=dt_timezone.utc))
    monkeypatch.setattr("django.utils.timezone.now", c)
    return c


@pytest.fixture
def sent(monkeypatch):
    calls = []
    monkeypatch.setattr("scheduler.dispatch._send", lambda task, node, args: calls.append((task, node, args)))
    return calls


def submit(demo, user="alice", project="vision", **over):
    data = {"project": project, "name": "j", "image": IMAGE, "command": ["true"], **over}
    job, _ = job_submit(actor=Actor(user=demo.users[user]), data=data)
    return job
