"""What every PostgreSQL scheduling test shares: the database check and a stand-in for the queue."""
import pytest
from django.db import connection


@pytest.fixture(autouse=True)
def _needs_postgres():
    """These tests need PostgreSQL (advisory locks, row locks, concurrent transactions): on another
    database they fail saying so rather than pass vacuously."""
    assert connection.vendor == "postgresql", "these tests need PostgreSQL: set DATABASE_URL (make test does)"


@pytest.fixture
def quiet(monkeypatch):
    """Passes send nothing (the broker is not part of these tests)."""
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
