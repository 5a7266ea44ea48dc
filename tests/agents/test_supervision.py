"""The supervisor's promise: whatever a report does (the portal answers 400 or 500, the client
raises), every pass still enforces time limits. Real sandboxes (process, docker), the real HTTP
client, a stub portal that refuses every log chunk."""

import time

import pytest

from agents.client import PortalClient
from agents.probe.sim import SimProbe
from agents.worker import Agent
from tests.agents.conftest import JOB_IMAGE
from tests.agents.portal_stub import TOKEN, PortalStub

# NUL and invalid UTF-8, then more of it until stopped: what made the portal refuse chunks.
NASTY = ["sh", "-c", r"printf 'a\000b\377\376\n'; while :; do printf 'x\000\200'; sleep 0.1; done"]


@pytest.fixture
def stub():
    s = PortalStub()
    yield s
    s.close()


@pytest.fixture(params=["process", "docker"])
def driver(request, tmp_path):
    if request.param == "process":
        from agents.sandbox.process_driver import ProcessDriver

        yield ProcessDriver(node="sup", state_dir=str(tmp_path))
    else:
        yield request.getfixturevalue("docker_driver")


@pytest.fixture
def agent(stub, driver):
    client = PortalClient(stub.url, TOKEN, retries=0, backoff_s=0.01, timeout_s=5)
    a = Agent(name="sup", client=client, driver=driver, probe=SimProbe("1xH100-80GB", node_name="sup"),
              stop_grace_s=1.0, background=False, scrub_gpus=False)
    a.register()
    try:
        yield a
    finally:
        for t in a.jobs().values():
            driver.stop(t.handle, 0)
            driver.remove(t.handle)


def ended(stub, job_id):
    return [e for e in stub.calls(f"/jobs/{job_id}/events") if e["state"] not in ("starting", "running")]


@pytest.mark.parametrize("status", [400, 500])
def test_refused_log_reports_never_skip_the_time_limit(stub, agent, status):
    stub.refuse["/logs"] = status
    job_id = f"nasty-{status}"
    assert agent.launch(job_id, 1, {"image": JOB_IMAGE, "command": NASTY, "cpus": 0.5, "memory_mb": 64,
                                    "time_limit_s": 1}) == "started"
    deadline = time.monotonic() + 30
    while not ended(stub, job_id):
        assert time.monotonic() < deadline, f"no end reported; events: {stub.calls(f'/jobs/{job_id}/events')}"
        agent.supervise_once()
        time.sleep(0.1)
    (end,) = ended(stub, job_id)
    assert end["state"] == "timeout" and "time limit" in end["message"]
    assert stub.calls(f"/jobs/{job_id}/logs")  # the chunks were tried, and refused
    assert agent.jobs() == {} and agent.driver.list_own() == []  # nothing left behind
