"""What supervising a docker job costs the engine, against the real engine: one inspect a running
job a pass (its log reads use the poll's; none makes the docker SDK's TTY inspect)."""

from agents.probe.sim import SimProbe
from agents.sandbox import RUNNING
from agents.worker import Agent
from tests.agents.conftest import make_spec
from tests.agents.fakes import Clock, FakePortal
from tests.procs import wait_for


def count_inspects(driver) -> list:
    calls = []
    inspect = driver.client.api.inspect_container
    driver.client.api.inspect_container = lambda ref, *a, **k: calls.append(ref) or inspect(ref, *a, **k)
    return calls


def test_a_running_jobs_pass_inspects_its_container_once_and_still_ships_its_log(docker_driver):
    agent = Agent(name="n1", client=FakePortal(Clock()), driver=docker_driver,
                  probe=SimProbe("1xH100-80GB", node_name="n1"), stop_grace_s=0.0, background=False,
                  scrub_gpus=False)
    spec = make_spec(command=["sh", "-c", "echo first; sleep 1; echo second; sleep 30"])
    assert agent.launch(spec.job_id, 1, {"image": spec.image, "command": spec.command, "cpus": 0.5,
                                         "memory_mb": 64, "time_limit_s": 60}) == "started"
    (t,) = agent.jobs().values()
    container = docker_driver.client.containers.get(t.handle.ref)
    wait_for(lambda: b"first" in container.logs(), 15, "the job's first line")
    calls = count_inspects(docker_driver)
    agent.supervise_once()
    # The poll's inspect only: the reads (the new lines, then nothing more) used the poll's container,
    # and neither made the docker SDK's TTY inspect.
    assert calls == [t.handle.ref]
    assert agent.client.log_text(spec.job_id).startswith("first\n")
    wait_for(lambda: agent.supervise_once() or "second" in agent.client.log_text(spec.job_id), 15,
             "the second line shipped")
    assert docker_driver.poll(t.handle)[0] == RUNNING
    agent.stop(spec.job_id, 1, "done", 0)
    assert agent.client.states(spec.job_id)[-1] == "cancelled" and agent.jobs() == {}
