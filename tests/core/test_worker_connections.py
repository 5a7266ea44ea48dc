"""The Celery worker reuses its database connection across tasks (issue 14): Celery's Django
fixup is told to keep it, and each task closes it only when a web request would (too old, or
broken); a task run eagerly leaves its caller's connection alone."""
from types import SimpleNamespace

import pytest
from django.db import connection

from portal.celery import _reuse_connections, app


def test_the_fixup_keeps_connections_between_tasks():
    assert app.conf.get("CELERY_DB_REUSE_MAX") >= 100


@pytest.mark.django_db
def test_an_eager_task_leaves_its_callers_connection_alone():
    connection.ensure_connection()
    _reuse_connections(task=SimpleNamespace(request=SimpleNamespace(is_eager=True)))
    assert connection.connection is not None and connection.is_usable()


@pytest.mark.django_db(transaction=True)
def test_a_worker_task_closes_a_connection_past_its_age(monkeypatch):
    connection.close()  # a young one: this process's may be older than CONN_MAX_AGE by now
    connection.ensure_connection()
    worker_task = SimpleNamespace(request=SimpleNamespace(is_eager=False))
    _reuse_connections(task=worker_task)  # young and usable: kept
    assert connection.connection is not None
    monkeypatch.setattr(connection, "close_at", 0.0)  # past CONN_MAX_AGE
    _reuse_connections(task=worker_task)
    assert connection.connection is None
