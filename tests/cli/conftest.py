"""gpuctl against a live portal: pytest-django's live_server, real HTTP, the demo personas.

There is no agent here. A test that needs a job to move runs the scheduling pass and the
state transitions itself from a background thread (`drive`), while gpuctl polls the API.
`requests_seen` counts gpuctl's finished HTTP requests per path, so a driver can wait until
gpuctl has really looked again after each change instead of sleeping and hoping.
"""
import threading
from collections import Counter

import pytest
from django.db import connection, connections
from typer.testing import CliRunner

from portal.cli.app import app
from portal.cli.client import Client
from portal.core.context import Actor
from portal.nodes.services import node_add
from tests.conftest import make_token
from tests.procs import wait_for


@pytest.fixture
def portal(live_server, transactional_db, demo, monkeypatch, tmp_path):
    """The live portal with one 8-GPU node; gpuctl is configured (by environment) as alice."""
    # No broker in these tests: pass requests and node commands go nowhere.
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: None)
    monkeypatch.setattr("scheduler.dispatch._send", lambda task, node, args: None)
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    demo.url = live_server.url
    demo.token = {name: make_token(demo.users[name]) for name in ("alice", "bob", "charlie", "dave")}
    demo.config = tmp_path / "gpuctl" / "config.json"
    monkeypatch.setenv("GPUCTL_CONFIG", str(demo.config))
    monkeypatch.setenv("GPUCTL_URL", live_server.url)
    monkeypatch.setenv("GPUCTL_TOKEN", demo.token["alice"])
    return demo


@pytest.fixture
def gpuctl():
    """Run gpuctl in-process: gpuctl("list", "-o", "json") -> click Result (stdout, stderr, exit_code)."""
    runner = CliRunner()

    def run(*args, input=None):
        return runner.invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)

    return run


@pytest.fixture
def requests_seen(monkeypatch):
    counter = Counter()
    real = Client.request

    def counting(self, method, path, **kwargs):
        try:
            return real(self, method, path, **kwargs)
        finally:
            counter[path] += 1

    monkeypatch.setattr(Client, "request", counting)
    return counter


def polled_again(counter, path, times=2):
    """Block until gpuctl has finished `times` more requests to `path` (so at least one began after now)."""
    start = counter[path]
    wait_for(lambda: counter[path] >= start + times, what=f"gpuctl to poll {path}")


@pytest.fixture
def drive(portal):
    """drive(fn): run fn in a thread (with its own DB connection); re-raise its error at teardown."""
    # SQLite's shared in-memory test database answers "table is locked" to a second writer.
    assert connection.vendor == "postgresql", \
        "tests that move a job from a second thread need PostgreSQL: set DATABASE_URL (make test does)"
    threads = []

    def start(fn):
        def body():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                thread.error = exc
            finally:
                connections.close_all()

        thread = threading.Thread(target=body, daemon=True)
        thread.error = None
        threads.append(thread)
        thread.start()
        return thread

    yield start
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "the driver thread did not finish"
        if thread.error:
            raise thread.error
