"""The health check of persistent PostgreSQL connections (portal/core/postgres): no statement for
a healthy idle connection; a connection the server ended (terminated backend, restart) is found
unusable and replaced before the request's first statement."""
import time

import pytest
from django.db import connection, connections


@pytest.fixture
def pg():
    assert connection.vendor == "postgresql", "this test needs PostgreSQL: set DATABASE_URL (make test does)"
    assert connections["default"].__class__.__module__ == "portal.core.postgres.base"


@pytest.mark.django_db(transaction=True)
def test_an_idle_healthy_connection_is_usable_without_asking_the_server(pg, monkeypatch):
    connection.ensure_connection()
    raw = connection.connection
    asked = []
    real_cursor = raw.cursor
    monkeypatch.setattr(raw, "cursor", lambda *a, **kw: asked.append(1) or real_cursor(*a, **kw))
    monkeypatch.setattr(raw, "execute", lambda *a, **kw: asked.append(1))
    for _ in range(20):
        assert connection.is_usable()
    assert asked == []
    # Something waiting on the socket (here a notification the server sends unasked) is checked with the server.
    monkeypatch.undo()
    raw.execute("LISTEN gpuportal_test")
    other = connections.create_connection("default")
    try:
        other.ensure_connection()
        other.connection.execute("NOTIFY gpuportal_test")  # arrives on the idle connection's socket
        monkeypatch.setattr(raw, "cursor", lambda *a, **kw: asked.append(1) or real_cursor(*a, **kw))
        deadline = time.monotonic() + 10
        while not asked and time.monotonic() < deadline:
            assert connection.is_usable()
            time.sleep(0.01)
        assert asked, "a notification waiting on the socket should have been checked with SELECT 1"
    finally:
        other.close()
        monkeypatch.undo()
        raw.execute("UNLISTEN gpuportal_test")


@pytest.mark.django_db(transaction=True)
def test_a_connection_the_server_ended_is_unusable_and_replaced(pg):
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    other = connections.create_connection("default")
    try:
        other.ensure_connection()
        with other.connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [pid])
            assert cur.fetchone()[0] is True
    finally:
        other.close()
    deadline = time.monotonic() + 10  # the backend ends and says so a moment after the call returns
    while connection.is_usable() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not connection.is_usable()
    # As a request does: the check before first use replaces it, and the statement succeeds.
    connection.health_check_done = False
    connection.close_if_health_check_failed()
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        assert cur.fetchone()[0] != pid
