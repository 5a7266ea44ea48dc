"""A pinned wall clock for tests that reason about calendar time (months, days, hours, budgets,
invoices, leases, idle detection, retention): such a test passes whatever the date it runs.

- The `clock` fixture pins the wall clock with time-machine: `datetime.now()`,
  `django.utils.timezone.now()`, `time.time()` and `auto_now` fields all read it, and it does not
  move by itself. `clock()` is now, `clock.advance(minutes=5)` moves it, `clock.month_start` is
  when the current UTC month began. `time.monotonic()` is not pinned, so deadlines still expire.
- `@pytest.mark.clock` (on a test, or a module's `pytestmark`) says a test must pass at any
  instant: each marked test that uses the `clock` fixture (itself or through another fixture) runs
  once per instant chosen with `--clock-instants`, its id naming the instant
  (`test_x[month-start]`), with `clock` pinned there. Without the marker `clock` pins the
  ordinary instant. The clock is pinned before the test's other fixtures run.

`--clock-instants` (default: the `clock_instants` line of pytest.ini, `all`): `all` (every named
instant below), a comma-separated list of names or ISO 8601 instants
(`month-end,2027-03-31T23:59:30Z`), or `now` (pinned where the real clock is when the test starts).
`--clock-instants=ordinary` runs each marked test once.

Processes started by a test (agents, Celery workers, live servers) keep the real clock: tests
that start them do not use this fixture.
"""
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
import time_machine

UTC = dt_timezone.utc

INSTANTS = {
    "ordinary": datetime(2026, 11, 18, 14, 30, tzinfo=UTC),  # mid-month, mid-day
    "month-start": datetime(2026, 12, 1, 0, 5, tzinfo=UTC),  # "two hours ago" was last month
    "month-end": datetime(2026, 11, 30, 23, 55, tzinfo=UTC),  # a new month minutes away
    "year-end": datetime(2026, 12, 31, 23, 58, tzinfo=UTC),  # a new month and a new year
    "leap-day": datetime(2028, 2, 29, 12, 0, tzinfo=UTC),  # 29 February
}


def month_start(dt: datetime) -> datetime:
    return dt.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


class Clock:
    """The test's wall clock: pinned by time-machine, moved only by the test."""

    def __init__(self, traveller):
        self._traveller = traveller

    def __call__(self) -> datetime:
        return datetime.now(UTC)

    def advance(self, **kw) -> datetime:
        self._traveller.shift(timedelta(**kw))
        return self()

    def move_to(self, instant: datetime) -> datetime:
        self._traveller.move_to(instant)
        return self()

    @property
    def month_start(self) -> datetime:
        return month_start(self())

    def ago_this_month(self, **kw) -> datetime:
        """`kw` ago, or the start of this month if that is later: usage that counts this month."""
        return max(self() - timedelta(**kw), self.month_start)


def _instants(config) -> list[tuple[str, datetime | None]]:
    out = []
    words = config.getoption("clock_instants") or config.getini("clock_instants") or "ordinary"
    for word in filter(None, (w.strip() for w in words.split(","))):
        if word == "all":
            out += [(name, instant) for name, instant in INSTANTS.items()]
        elif word == "now":
            out.append(("now", None))
        elif word in INSTANTS:
            out.append((word, INSTANTS[word]))
        else:
            try:
                instant = datetime.fromisoformat(word.replace("Z", "+00:00"))
            except ValueError:
                raise pytest.UsageError(f"--clock-instants: {word!r} is not all, now, one of "
                                        f"{', '.join(INSTANTS)} or an ISO 8601 instant") from None
            out.append((word, instant if instant.tzinfo else instant.replace(tzinfo=UTC)))
    return list(dict(out).items()) or [("ordinary", INSTANTS["ordinary"])]


def pytest_addoption(parser):
    text = ("instants at which tests marked `clock` run: all, now, or a comma-separated list of "
            f"{', '.join(INSTANTS)} and ISO 8601 instants")
    parser.addoption("--clock-instants", metavar="LIST", help=text + " (default: the clock_instants ini line)")
    parser.addini("clock_instants", text + " (default: ordinary)", default="ordinary")


def pytest_configure(config):
    config.addinivalue_line("markers", "clock: the test must pass at any instant; it runs at each of "
                                       "--clock-instants with the `clock` fixture pinned there")
    _instants(config)  # a bad value fails before collection


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("clock") is None or "clock" not in metafunc.fixturenames:
        return
    names, instants = zip(*_instants(metafunc.config))
    metafunc.parametrize("clock", instants, ids=names, indirect=True)


def pytest_collection_modifyitems(items):
    # Pin the clock before the test's other fixtures build anything (a token issued at the real
    # time would have expired at an instant a year later).
    for item in items:
        names = getattr(item, "fixturenames", None)
        if names and "clock" in names:
            names.remove("clock")
            names.insert(0, "clock")


@pytest.fixture
def clock(request):
    """The pinned wall clock (see the module docstring)."""
    instant = getattr(request, "param", INSTANTS["ordinary"])
    if instant is None:  # --clock-instants=now
        instant = datetime.now(UTC)
    with time_machine.travel(instant, tick=False) as traveller:
        yield Clock(traveller)
