"""The agent's --broker flag wins over CELERY_BROKER_URL in its environment (Celery itself reads the
environment first), against the real Redis of the test environment."""
import os

from celery import Celery
from django.conf import settings

from agents.__main__ import use_broker


def test_the_broker_flag_wins_over_the_environment(monkeypatch):
    flag = settings.CELERY_BROKER_URL  # the test environment's Redis: it answers
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:9/0")  # nothing listens there
    monkeypatch.setenv("CELERY_BROKER_READ_URL", "redis://127.0.0.1:9/1")
    app = Celery("broker-flag")
    use_broker(app, flag)
    assert os.environ["CELERY_BROKER_URL"] == flag and "CELERY_BROKER_READ_URL" not in os.environ
    for conn in (app.connection_for_read(), app.connection_for_write()):
        with conn:
            assert conn.as_uri() == app.connection(flag).as_uri()
            conn.ensure_connection(max_retries=1, timeout=5)  # the flag's broker, reached
