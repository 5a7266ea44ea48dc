"""The whole agent as it runs in production: ``python -m agents`` as a process,
the portal's HTTP API (a stub on 127.0.0.1), a Celery broker (filesystem
transport in a temp dir) and the real Docker engine."""

import base64
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from celery import Celery

from tests.agents.conftest import JOB_IMAGE
from tests.agents.portal_stub import TOKEN, PortalStub
from tests.procs import start_process, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def agent_process(tmp_path, docker_client, node_name, broker: list[str], send=None):
    """``python -m agents`` on a stub portal reading its queue from ``broker`` (its --broker options),
    until the block ends; then its sandboxes go."""
    stub = PortalStub()
    log = open(tmp_path / "agent.log", "w+")

    def agent_log():
        log.seek(0)
        return log.read()

    proc = start_process(
        [sys.executable, "-m", "agents", "--portal", stub.url, "--token", TOKEN, *broker, "--name", node_name,
         "--gpus", "sim:2xH100-80GB", "--sandbox", "docker", "--stop-grace", "1"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "ready." in agent_log() or proc.poll() is not None, 30, "the Celery worker")
        assert proc.poll() is None, agent_log()
        yield type("Stack", (), dict(stub=stub, send=send, log=agent_log, proc=proc))
    finally:
        stop_process(proc, grace_s=15)
        stub.close()
        log.close()
        for c in docker_client.containers.list(all=True, filters={"label": [f"gpuportal.node={node_name}"]}):
            c.remove(force=True)


@pytest.fixture
def stack(tmp_path, docker_client, node_name, monkeypatch):
    folder = tmp_path / "broker"
    folder.mkdir()
    # Celery reads CELERY_BROKER_URL (make test sets it) before its own broker setting; the agent's
    # --broker wins over it, so this producer must not follow it either.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    producer = Celery("portal-side", broker="filesystem://")
    producer.conf.broker_transport_options = {"data_folder_in": str(folder), "data_folder_out": str(folder)}

    def send(name, *args):
        producer.send_task(name, args=list(args), queue=f"node.{node_name}")

    with agent_process(tmp_path, docker_client, node_name, ["--broker", "filesystem://", "--broker-folder", str(folder)],
                       send) as s:
        yield s


def test_agent_runs_a_job_end_to_end(stack):
    s = stack
    reg = s.stub.calls("/register")[0]
    assert reg["sandbox"] == "docker" and len(reg["gpus"]) == 2 and s.stub.calls("/heartbeat")
    assert reg["capabilities"]["simulated_gpus"] is True and "gpus_unusable" not in reg
    s.stub.stale.add(("stale-1", 1))
    s.send("agent.launch", "stale-1", 1, {"image": JOB_IMAGE, "command": ["true"]})
    s.send("agent.launch", "e2e-1", 1, {"image": JOB_IMAGE, "command": ["sh", "-c", "echo hello from $GPUPORTAL_JOB_ID"],
                                        "cpus": 0.5, "memory_mb": 64, "time_limit_s": 30})

    def states():
        return [e["state"] for e in s.stub.calls("/jobs/e2e-1/events")]

    wait_for(lambda: "succeeded" in states(), 30, f"e2e-1 to succeed; log:\n{s.log()}")
    # The confirmation made it starting; the agent reports from running on.
    assert s.stub.calls("/jobs/e2e-1/confirm") and states() == ["running", "succeeded"]
    assert b"".join(base64.b64decode(c["data_base64"]) for c in s.stub.calls("/jobs/e2e-1/logs")) \
        == b"hello from e2e-1\n"
    assert s.stub.calls("/jobs/stale-1/events") == []  # confirm said 409: nothing started

    # A job past its time limit is stopped and reported as timeout.
    s.send("agent.launch", "e2e-2", 1, {"image": JOB_IMAGE, "command": ["sleep", "300"], "memory_mb": 64,
                                        "time_limit_s": 1})
    wait_for(lambda: any(e["state"] == "timeout" for e in s.stub.calls("/jobs/e2e-2/events")), 30,
             f"e2e-2 to time out; log:\n{s.log()}")

    # agent.stop from the queue.
    s.send("agent.launch", "e2e-3", 1, {"image": JOB_IMAGE, "command": ["sleep", "300"], "memory_mb": 64})
    wait_for(lambda: any(e["state"] == "running" for e in s.stub.calls("/jobs/e2e-3/events")), 30, "e2e-3 running")
    s.send("agent.stop", "e2e-3", 1, "cancelled by alice", 1.0)
    wait_for(lambda: any(e["state"] == "cancelled" for e in s.stub.calls("/jobs/e2e-3/events")), 30,
             f"e2e-3 cancelled; log:\n{s.log()}")
    (ev,) = [e for e in s.stub.calls("/jobs/e2e-3/events") if e["state"] == "cancelled"]
    assert ev["message"] == "cancelled by alice"


def test_agent_answers_the_portals_probe_from_its_queue(stack):
    """The probe proves the agent reads node.<name> (its --broker and queue folder are right):
    what the portal puts on the queue comes back through the agent API."""
    nonce = "5e" * 16
    stack.send("agent.probe", nonce)
    wait_for(lambda: stack.stub.calls("/probe"), 30, f"the probe's answer; log:\n{stack.log()}")
    assert stack.stub.calls("/probe") == [{"nonce": nonce}]
    # The agent logs the answer after the portal has taken it: wait for the line, don't race it.
    wait_for(lambda: "queue probe answered" in stack.log(), 10, f"the probe's log line; log:\n{stack.log()}")


@pytest.fixture
def redis_agent(tmp_path, docker_client, node_name):
    """The agent process reading its queue on the portal's own Redis broker (CELERY_BROKER_URL)."""
    from django.conf import settings

    assert settings.CELERY_BROKER_URL.startswith("redis://"), "this test needs the Redis broker (make test sets it)"
    with agent_process(tmp_path, docker_client, node_name, ["--broker", settings.CELERY_BROKER_URL]) as s:
        yield s


def test_the_portals_pipelined_launches_reach_the_agent_one_message_per_node_or_one_each(redis_agent, node_name):
    """scheduler.dispatch publishes a pass's launches in one Redis pipeline without declaring the
    queue: an agent of protocol 1.4 gets them in one agent.launches message, an older one (the
    same agent here) one agent.launch each; a stale job in a batch starts nothing, the others run."""
    from scheduler.dispatch import send_launches

    s = redis_agent
    s.stub.stale.add(("902", 1))

    def spec(job_id):
        return {"job_id": str(job_id), "attempt": 1, "image": JOB_IMAGE, "command": ["sh", "-c", "echo $GPUPORTAL_JOB_ID"],
                "cpus": 0.5, "memory_mb": 64, "time_limit_s": 30}

    def states(job_id):
        return [e["state"] for e in s.stub.calls(f"/jobs/{job_id}/events")]

    ids = [901, 902, 903]
    send_launches([(node_name, j, 1) for j in ids], {(node_name, j): spec(j) for j in ids}, batched={node_name})
    wait_for(lambda: "succeeded" in states(901) and "succeeded" in states(903), 60,
             f"both launches of the batch to succeed; log:\n{s.log()}")
    assert states(901) == states(903) == ["running", "succeeded"]  # starting: their confirmations
    assert s.stub.calls("/jobs/902/events") == []  # confirm said 409: nothing started
    send_launches([(node_name, 904, 1)], {(node_name, 904): spec(904)}, batched=set())  # protocol < 1.4
    wait_for(lambda: "succeeded" in states(904), 60, f"the single launch to succeed; log:\n{s.log()}")
    assert s.stub.calls("/jobs/902/events") == []
