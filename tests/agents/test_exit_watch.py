"""The agent learns of a sandbox's exit when it happens (a pidfd per process sandbox, the Docker
engine's die events), not at the supervisor's next tick: here the tick is an hour away, so every
end reported below was reported because the driver woke the agent."""
import contextlib
import threading

import pytest

from agents.probe.sim import SimProbe
from agents.sandbox.process_driver import ProcessDriver
from agents.worker import Agent
from tests.agents.conftest import JOB_IMAGE
from tests.agents.fakes import Clock, FakePortal
from tests.procs import wait_for

NO_TICK_S = 3600.0


def supervised(driver, name):
    """An agent on ``driver`` whose supervisor's own tick never comes during the test."""
    portal = FakePortal(Clock())
    agent = Agent(name=name, client=portal, driver=driver, probe=SimProbe("1xH100-80GB", node_name=name),
                  stop_grace_s=1.0, scrub_gpus=False)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run_supervisor, args=(stop, NO_TICK_S), daemon=True)
    return portal, agent, stop, thread


@pytest.fixture
def process_agent(tmp_path):
    with process_supervised(tmp_path, "exits") as running:
        yield running


@contextlib.contextmanager
def process_supervised(tmp_path, name):
    driver = ProcessDriver(node=name, state_dir=str(tmp_path))
    portal, agent, stop, thread = supervised(driver, name)
    try:
        yield portal, agent, thread
    finally:
        stop.set()
        agent._wake.set()
        thread.join(10)
        for _, _, handle in driver.list_own():
            driver.stop(handle, 0)
            driver.remove(handle)


def ended(portal, job_id) -> bool:
    return any(s in ("succeeded", "failed") for s in portal.states(job_id))


def test_a_process_jobs_exit_is_reported_without_waiting_for_a_tick(process_agent):
    portal, agent, thread = process_agent
    # Started before the supervisor watches (as after an agent restart): watched from its start.
    assert agent.launch("early", 1, {"image": "x", "command": ["sleep", "0.5"]}) == "started"
    thread.start()
    for k in range(5):  # several ending together
        assert agent.launch(f"j{k}", 1, {"image": "x", "command": ["sh", "-c", f"exit {k % 2}"]}) == "started"
    for job_id in ["early", *(f"j{k}" for k in range(5))]:
        wait_for(lambda: ended(portal, job_id), 20, f"the end of {job_id}")
    assert portal.states("j0")[-1] == "succeeded" and portal.states("j1")[-1] == "failed"
    assert agent.jobs() == {}  # reported and removed


def test_a_still_running_process_job_is_not_reported(process_agent):
    portal, agent, thread = process_agent
    thread.start()
    assert agent.launch("long", 1, {"image": "x", "command": ["sleep", "60"]}) == "started"
    assert agent.launch("short", 1, {"image": "x", "command": ["true"]}) == "started"
    wait_for(lambda: ended(portal, "short"), 20, "the short job's end")
    assert portal.states("long") == ["starting", "running"]


def test_a_docker_jobs_exit_is_reported_without_waiting_for_a_tick(docker_driver):
    portal, agent, stop, thread = supervised(docker_driver, docker_driver.node)
    thread.start()
    try:
        for k in range(3):
            assert agent.launch(f"d{k}", 1, {"image": JOB_IMAGE, "command": ["sh", "-c", f"exit {k}"],
                                             "memory_mb": 64}) == "started"
        for k in range(3):
            wait_for(lambda: ended(portal, f"d{k}"), 30, f"the end of d{k}")
        assert [portal.states(f"d{k}")[-1] for k in range(3)] == ["succeeded", "failed", "failed"]
        assert sorted(e[3] for e in portal.events if e[2] in ("succeeded", "failed")) == [0, 1, 2]
    finally:
        stop.set()
        agent._wake.set()
        thread.join(10)


def test_exits_close_together_are_reported_in_one_request(tmp_path):
    """Woken by an exit, the supervisor waits `end_gather_s` for others: two jobs ending 50 ms apart
    share one batched report (they would go in two requests without the wait)."""
    with process_supervised(tmp_path, "gather") as (portal, agent, thread):
        agent.end_gather_s = 1.0
        thread.start()
        assert agent.launch("a", 1, {"image": "x", "command": ["sleep", "0.3"]}) == "started"
        assert agent.launch("b", 1, {"image": "x", "command": ["sleep", "0.35"]}) == "started"
        wait_for(lambda: ended(portal, "a") and ended(portal, "b"), 20, "both ends")
        assert portal.batches == [[("a", 1, "succeeded"), ("b", 1, "succeeded")]]
