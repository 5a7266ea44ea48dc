"""A Redis restart under a real Celery worker of the agent's app (docs/reliability.md, F-06): with a task
running unacknowledged and the consumer polling, kombu used to crash the worker ("Unrecoverable error:
AttributeError: 'NoneType' object has no attribute 'hostname'") instead of reconnecting; the agent then
stopped heartbeating while it started again, and its jobs' leases ran out (agents/broker.py)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from tests.nodes.test_portal_outage import PrivateRedis
from tests.procs import start_process, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_server(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def worker(tmp_path, redis_server, monkeypatch):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    monkeypatch.setenv("CELERY_BROKER_URL", url)  # Celery prefers it to any broker given in code
    log = open(tmp_path / "worker.log", "a+")
    proc = start_process([sys.executable, "-m", "celery", "-A", "tests.agents.broker_app", "worker", "-P", "threads",
                          "-c", "4", "-Q", "t", "-n", "restart@%h", "--loglevel", "INFO"], cwd=ROOT,
                         env={**os.environ, "TEST_BROKER_URL": url}, stdout=log, stderr=subprocess.STDOUT)
    read = lambda: (tmp_path / "worker.log").read_text(errors="replace")  # noqa: E731
    try:
        wait_for(lambda: "ready." in read(), 60, "the worker to start")
        yield type("W", (), dict(proc=proc, log=read, sender=Celery(broker=url)))
    finally:
        stop_process(proc, 10)
        log.close()


@pytest.mark.parametrize("round_", range(3))
def test_the_worker_reconnects_after_a_redis_restart_with_a_task_running(tmp_path, redis_server, worker, round_):
    """Three rounds: the crash was a race (two agents of four in three runs of the fault suite)."""
    worker.sender.send_task("test.hold", args=[str(tmp_path)], queue="t")
    wait_for(lambda: (tmp_path / "held").exists(), 30, "the held task to run")
    redis_server.proc.send_signal(signal.SIGKILL)  # while the task runs and the consumer polls
    redis_server.proc.wait(10)
    wait_for(lambda: "Connection to broker lost" in worker.log(), 30, f"the worker to see the loss: {worker.log()[-1500:]}")
    redis_server.start()  # the same port, nothing kept
    (tmp_path / "release").touch()
    worker.sender.send_task("test.mark", args=[str(tmp_path), "after"], queue="t")
    wait_for(lambda: (tmp_path / "after").exists() or worker.proc.poll() is not None, 90,
             "a task sent after the restart to run")
    assert worker.proc.poll() is None, f"the worker exited: {worker.log()[-3000:]}"
    assert (tmp_path / "after").exists() and "Unrecoverable error" not in worker.log()
