"""The agent's Celery app (agents/tasks.py: its settings and the broker guard) with two tasks of the
broker-restart test's own, run by a real worker: ``test.hold`` runs (unacknowledged, acks_late) until
a file appears, ``test.mark`` writes a file."""
import os
import time
from pathlib import Path

from agents.tasks import app

app.conf.broker_url = os.environ["TEST_BROKER_URL"]


@app.task(name="test.hold")
def hold(folder: str) -> None:
    Path(folder, "held").touch()
    deadline = time.monotonic() + 60
    while not Path(folder, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


@app.task(name="test.mark")
def mark(folder: str, name: str) -> None:
    Path(folder, name).touch()
