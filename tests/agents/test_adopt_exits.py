"""Exit codes survive an agent restart, in every sandbox: an agent starts a job and goes away (its
sandbox keeps running), the job ends while no agent watches, and a new agent adopts what is left and
reports the job's real exit code once (0 -> succeeded, 3 -> failed with 3), then clears it. Real
sandboxes (a process, a container, a VM under QEMU), the real HTTP client, a stub portal."""

import shutil
import time
import uuid

import pytest

from agents.client import PortalClient
from agents.probe.sim import SimProbe
from agents.sandbox import RUNNING
from agents.worker import Agent
from tests.agents.conftest import JOB_IMAGE
from tests.agents.portal_stub import TOKEN, PortalStub
from tests.agents.test_kvm_boot import kvm_image  # noqa: F401 (the guest image fixture)


@pytest.fixture
def stub():
    s = PortalStub()
    yield s
    s.close()


@pytest.fixture(params=["process", "docker", "kvm"])
def drivers(request, tmp_path):
    """(the first agent's driver, a factory for the driver of the agent that replaces it): the same node,
    state folder and engine, as after a restart."""
    if request.param == "process":
        from agents.sandbox.process_driver import ProcessDriver

        yield ProcessDriver(node="adopt", state_dir=str(tmp_path)), lambda: ProcessDriver(
            node="adopt", state_dir=str(tmp_path))
    elif request.param == "docker":
        from agents.sandbox.docker_driver import DockerDriver

        client = request.getfixturevalue("docker_client")
        first = request.getfixturevalue("docker_driver")
        yield first, lambda: DockerDriver(node=first.node, client=client)
    else:
        from agents.sandbox.kvm_driver import KvmDriver
        from tests.agents.test_kvm_boot import URI, close_vm_driver, make_vm_driver

        request.getfixturevalue("docker_client")  # the job image comes from the engine
        image = request.getfixturevalue("kvm_image")
        first = make_vm_driver(image)
        later = []

        def again():
            later.append(KvmDriver(node=first.node, uri=URI, kernel=image.kernel, initrd=image.initrd,
                                   state_dir=str(first.state_dir.parent),
                                   vm_uids="-".join(map(str, first.vm_uids))))
            return later[-1]
        yield first, again
        for d in later:
            d.conn.close()
        close_vm_driver(first)


def make_agent(stub, driver):
    client = PortalClient(stub.url, TOKEN, retries=0, backoff_s=0.01, timeout_s=5)
    a = Agent(name="adopt", client=client, driver=driver, probe=SimProbe("1xH100-80GB", node_name="adopt"),
              stop_grace_s=1.0, background=False, scrub_gpus=False)
    a.register()
    return a


def ends(stub, job_id):
    return [e for e in stub.calls(f"/jobs/{job_id}/events") if e["state"] not in ("starting", "running")]


@pytest.mark.parametrize("code,state", [(0, "succeeded"), (3, "failed")])
def test_a_job_that_ends_while_its_agent_is_down_reports_its_real_exit_code(stub, drivers, code, state):
    first, restart = drivers
    job_id = f"adopt-{code}-{uuid.uuid4().hex[:6]}"
    spec = {"image": JOB_IMAGE, "command": ["sh", "-c", f"echo before; sleep 2; echo after; exit {code}"],
            "cpus": 1, "memory_mb": 64, "time_limit_s": 1, "sandbox": "kvm" if first.name == "kvm" else "docker"}
    agent = make_agent(stub, first)
    assert agent.launch(job_id, 1, spec) == "started"
    handle = agent.jobs()[(job_id, 1)].handle
    del agent  # the agent goes; its sandbox does not

    # The job ends (past its time limit, too) while no agent watches it.
    deadline = time.monotonic() + 120
    while first.poll(handle)[0] == RUNNING:
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.2)

    later = restart()
    agent = make_agent(stub, later)
    assert agent.reconcile() == [(job_id, 1)]
    agent.heartbeat_once()  # what it holds, as the portal's reconciliation reads it
    assert {"job_id": job_id, "attempt": 1, "state": "running"} in stub.calls("/heartbeat")[-1]["jobs"]
    deadline = time.monotonic() + 30
    while not ends(stub, job_id):
        assert time.monotonic() < deadline, f"no end reported: {stub.calls(f'/jobs/{job_id}/events')}"
        agent.supervise_once()
        time.sleep(0.1)
    (end,) = ends(stub, job_id)
    assert (end["state"], end.get("exit_code")) == (state, code), end
    assert b"after" in b"".join(_chunks(stub, job_id))  # the log's tail came along
    # Reported once, then cleared: a third agent finds nothing of it.
    assert agent.jobs() == {} and later.list_own() == [] and restart().list_own() == []
    agent.supervise_once()
    assert len(ends(stub, job_id)) == 1


def test_the_process_sandbox_keeps_its_state_in_a_private_folder(tmp_path):
    """No predictable /tmp folder: the driver's folder is made 0700 in the agent's state folder, and one
    someone else could swap (a symlink planted where it goes) is refused, never followed."""
    import os
    import stat

    from agents.sandbox import SandboxError
    from agents.sandbox.process_driver import ProcessDriver

    d = ProcessDriver(node="n/1", state_dir=str(tmp_path / "agent"))
    assert d.state_dir == tmp_path / "agent" / "process-n_1"
    assert stat.S_IMODE(os.lstat(d.state_dir).st_mode) == 0o700
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "agent" / "process-n2").symlink_to(elsewhere)
    with pytest.raises(SandboxError, match="symlink"):
        ProcessDriver(node="n2", state_dir=str(tmp_path / "agent"))
    shutil.rmtree(elsewhere)


def _chunks(stub, job_id):
    import base64

    return [base64.b64decode(b["data_base64"]) for b in stub.calls(f"/jobs/{job_id}/logs")]
