"""The per-job supervisor fences a process-sandbox job when the node's lease file runs out, with no
agent process alive (agents/supervisor/, docs/reliability.md "Fencing without the agent")."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agents.client import PortalClient
from agents.probe.sim import SimProbe
from agents.sandbox import EXITED, RUNNING
from agents.sandbox.process_driver import ProcessDriver, _alive
from agents.supervisor.lease import FENCED, fenced_marker, read_lease, write_lease
from agents.worker import Agent
from tests.agents.conftest import make_spec
from tests.agents.portal_stub import TOKEN, PortalStub
from tests.agents.test_kvm_boot import close_vm_driver, kvm_image, make_vm_driver  # noqa: F401 (a fixture)
from tests.agents.test_lease import wait_for

GRACE_S = 1.0
CHECK_S = 0.5  # agents/supervisor/lease.py re-reads the deadline this often


# Launches a job that ignores SIGTERM (so only the SIGKILL after the grace ends it) from a driver in a
# process of its own, prints the job's shell pid and the sandbox ref, then waits to be killed.
LAUNCHER = textwrap.dedent("""
    import sys, time
    from agents.sandbox.process_driver import ProcessDriver
    from tests.agents.conftest import make_spec
    d = ProcessDriver(node="fence", state_dir=sys.argv[1])
    h = d.launch(make_spec(command=["sh", "-c", "echo $$ > pid; trap '' TERM; sleep 300"]))
    print(h.ref, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def launcher(tmp_path):
    procs = []

    def start():
        p = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd())
        procs.append(p)
        return p, p.stdout.readline().strip()
    yield start
    for p in procs:
        p.kill()
        p.wait()
    d = ProcessDriver(node="fence", state_dir=str(tmp_path))
    for _, _, h in d.list_own():
        d.stop(h, 0)
        d.remove(h)


def test_a_job_is_killed_at_its_lease_deadline_with_no_agent_alive(tmp_path, launcher):
    driver = ProcessDriver(node="fence", state_dir=str(tmp_path))
    write_lease(driver.lease_path, time.time() + 2.0, GRACE_S)
    agent, ref = launcher()
    pid_file = driver.state_dir / ref / "work" / "pid"
    wait_for(pid_file.exists, 10, "the job to start")
    job_pid = int(pid_file.read_text())
    agent.kill()  # the "agent" (the driver's process) dies: nothing renews the lease, nothing stops the job
    agent.wait()
    assert _alive(job_pid, None)
    deadline = read_lease(driver.lease_path)[0]
    wait_for(lambda: not _alive(job_pid, None), deadline - time.time() + GRACE_S + CHECK_S + 3,
             "the supervisor to kill the job")
    # SIGTERM was ignored: it took the SIGKILL after the grace, and not before the deadline.
    assert time.time() >= deadline + GRACE_S - 0.1
    # A restarted agent adopts the attempt and reads the fence from the exit record, once the
    # supervisor is gone too (the one SIGKILL to the group ends the job and it in either order).
    (_, _, handle), = driver.list_own()
    wait_for(lambda: driver.poll(handle)[0] != RUNNING, 10, "the supervisor to end")
    assert driver.poll(handle) == (FENCED, 128 + signal.SIGKILL)
    assert b"lease ran out" in driver.read_logs(handle, 0)


@contextlib.contextmanager
def renewing(lease_path, lease_s):
    """An agent that renews the lease file every 0.2 s, by lease_s from now."""
    write_lease(lease_path, time.time() + lease_s, GRACE_S)
    stop = threading.Event()

    def renew():
        while not stop.wait(0.2):
            write_lease(lease_path, time.time() + lease_s, GRACE_S)
    th = threading.Thread(target=renew, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join(5)


def test_a_job_whose_lease_is_renewed_runs_to_its_end(tmp_path):
    driver = ProcessDriver(node="renew", state_dir=str(tmp_path))
    with renewing(driver.lease_path, 1.0):
        h = driver.launch(make_spec(command=["sh", "-c", "sleep 4; exit 5"]))  # four leases long
        try:
            wait_for(lambda: driver.poll(h)[0] != RUNNING, 15, "the job to end")
            assert driver.poll(h) == (EXITED, 5)
        finally:
            driver.remove(h)


def test_a_missing_lease_file_means_launch_time_plus_the_lease(tmp_path):
    driver = ProcessDriver(node="nolease", state_dir=str(tmp_path))
    driver.lease_s, driver.fence_grace_s = 1.0, 0.5
    t0 = time.time()
    h = driver.launch(make_spec(command=["sleep", "60"]))
    try:
        wait_for(lambda: driver.poll(h)[0] != RUNNING, 1.0 + 0.5 + CHECK_S + 3, "the fallback lease to run out")
        assert driver.poll(h) == (FENCED, 128 + signal.SIGTERM) and time.time() - t0 >= 1.0
    finally:
        driver.remove(h)


def test_the_agent_renews_the_lease_file_and_a_stopped_agent_s_job_is_fenced(tmp_path):
    """A real agent (HTTP client, portal stub) keeps its job alive past several leases; once it stops
    renewing (its threads stopped: dead or frozen) the supervisor alone ends the job, reported right."""
    stub = PortalStub()
    driver = ProcessDriver(node="agentlease", state_dir=str(tmp_path))
    agent = Agent(name="agentlease", client=PortalClient(stub.url, TOKEN, timeout_s=2, retries=0), driver=driver,
                  probe=SimProbe("1xH100-80GB", node_name="agentlease"), stop_grace_s=1.0, scrub_gpus=False)
    stop = threading.Event()
    try:
        agent.register()
        agent.heartbeat_interval_s, agent.lease_s, agent.fence_grace_s = 0.3, 2.0, 0.5
        th = threading.Thread(target=agent.run_heartbeats, args=(stop,), daemon=True)
        th.start()
        assert agent.launch("j1", 1, {"image": "busybox", "command": ["sleep", "120"], "sandbox": "process", "time_limit_s": 300,
                                      "cpus": 1, "memory_mb": 64}) == "started"
        (_, _, h), = driver.list_own()
        t_end = time.monotonic() + 3 * agent.lease_s
        while time.monotonic() < t_end:  # three leases long, renewed: it runs
            assert driver.poll(h)[0] == RUNNING
            time.sleep(0.1)
        deadline, grace = read_lease(driver.lease_path)
        assert time.time() < deadline <= time.time() + agent.lease_s and grace == 0.5
        stop.set()
        th.join(5)
        wait_for(lambda: driver.poll(h)[0] != RUNNING, 2.0 + 0.5 + CHECK_S + 3, "the supervisor to fence the job")
        assert driver.poll(h)[0] == FENCED
        agent.supervise_once()  # the agent, back, reports it as fenced
        wait_for(lambda: "failed" in [c["state"] for c in stub.calls("/jobs/j1/events")], 10, "the report")
        assert "lease ran out" in stub.calls("/jobs/j1/events")[-1]["message"]
        assert stub.calls("/jobs/j1/events")[-1]["lease_expired"] is True  # the portal requeues it
    finally:
        stop.set()
        for _, _, h in driver.list_own():
            driver.stop(h, 0)
            driver.remove(h)
        stub.close()


@pytest.fixture
def supervised_docker(docker_client, node_name, tmp_path):
    from agents.sandbox.docker_driver import DockerDriver

    d = DockerDriver(node=node_name, client=docker_client, state_dir=str(tmp_path), supervise=True)
    yield d
    for c in docker_client.containers.list(all=True, filters={"label": [f"gpuportal.node={node_name}"]}):
        c.remove(force=True)
    if d.node_supervisor is not None:
        d.node_supervisor.kill()
        d.node_supervisor.wait()


def test_the_nodes_containers_are_killed_at_its_lease_deadline_by_one_supervisor(supervised_docker, docker_client):
    """The node's supervisor is one process of its own session for all its containers: the driver object
    (the agent) does nothing after the launches, yet both containers end at the deadline, SIGTERM ignored,
    SIGKILL after the grace; then the supervisor ends, its node having nothing left to guard."""
    d = supervised_docker
    write_lease(d.lease_path, time.time() + 3.0, GRACE_S)
    hs = [d.launch(make_spec(command=["sh", "-c", "trap '' TERM; sleep 300"])) for _ in range(2)]
    sup = d.node_supervisor
    assert sup is not None and os.getsid(sup.pid) == sup.pid  # outlives the agent's session
    assert all(d.poll(h)[0] == RUNNING for h in hs)
    deadline = read_lease(d.lease_path)[0]
    for h in hs:
        wait_for(lambda: d.poll(h)[0] != RUNNING, deadline - time.time() + GRACE_S + CHECK_S + 10,
                 "the supervisor to kill the container")
    assert time.time() >= deadline + GRACE_S - 0.2
    for h in hs:
        # Polled as the lease's doing (the supervisor's marker), so the agent reports a node fault.
        assert d.poll(h) == (FENCED, 128 + signal.SIGKILL)
    assert sup.wait(10) == 0  # and then it ends itself
    for h in hs:
        d.remove(h)
        assert not os.path.exists(fenced_marker(d.lease_path, h.ref))  # the marker goes with its container


def test_one_supervisor_serves_every_launch_and_outlives_the_containers_while_the_lease_holds(supervised_docker):
    d = supervised_docker
    with renewing(d.lease_path, 1.5):
        h = d.launch(make_spec(command=["sh", "-c", "sleep 5; exit 4"]))  # three leases long
        sup = d.node_supervisor
        h2 = d.launch(make_spec(command=["true"]))
        assert d.node_supervisor is sup  # its lock is held: no second process
        wait_for(lambda: d.poll(h)[0] != RUNNING, 30, "the container to end")
        assert d.poll(h) == (EXITED, 4) and d.poll(h2) == (EXITED, 0)
        d.remove(h)
        d.remove(h2)
        time.sleep(1.0)  # several of its turns: it stays for the node's next launch
        assert sup.poll() is None


def test_a_launch_after_the_supervisor_ended_starts_another(supervised_docker):
    """The supervisor ends once the lease is out and no container is left; the agent, back and renewed,
    starts a new one with its next launch, which is then fenced as the first would have been."""
    d = supervised_docker
    write_lease(d.lease_path, time.time() - 1.0, GRACE_S)  # already out, nothing running
    d.ensure_supervisor()
    first = d.node_supervisor
    assert first.wait(10) == 0
    write_lease(d.lease_path, time.time() + 2.0, GRACE_S)
    h = d.launch(make_spec(command=["sleep", "300"]))
    assert d.node_supervisor is not first and d.node_supervisor.poll() is None
    wait_for(lambda: d.poll(h)[0] != RUNNING, 2.0 + GRACE_S + CHECK_S + 10, "the new supervisor to fence")
    assert d.poll(h)[0] == FENCED


def test_an_agent_adopting_containers_starts_a_supervisor_when_theirs_is_gone(supervised_docker, docker_client):
    from agents.sandbox.docker_driver import DockerDriver

    d = supervised_docker
    write_lease(d.lease_path, time.time() + 3600, GRACE_S)
    h = d.launch(make_spec(command=["sleep", "300"]))
    d.node_supervisor.kill()  # by hand
    d.node_supervisor.wait()
    again = DockerDriver(node=d.node, client=docker_client, state_dir=d.state_dir, supervise=True)
    assert [x[2].ref for x in again.list_own()] == [h.ref]
    try:
        assert again.node_supervisor is not None and again.node_supervisor.poll() is None
        write_lease(d.lease_path, time.time() + 1.0, GRACE_S)
        wait_for(lambda: d.poll(h)[0] != RUNNING, 1.0 + GRACE_S + CHECK_S + 10, "the new supervisor to fence")
        assert d.poll(h)[0] == FENCED
        assert again.node_supervisor.wait(10) == 0
    finally:
        again.node_supervisor.kill()
        again.node_supervisor.wait()


def test_a_vm_is_destroyed_at_its_lease_deadline_by_its_own_supervisor(kvm_image, docker_client):
    d = make_vm_driver(kvm_image, supervise=True)
    try:
        write_lease(d.lease_path, time.time() + 3.0, GRACE_S)
        h = d.launch(make_spec(command=["sleep", "300"]))
        sup = d._supervisors[h.ref]
        assert os.getsid(sup.pid) == sup.pid and d.poll(h)[0] == RUNNING
        deadline = read_lease(d.lease_path)[0]
        wait_for(lambda: not d._active(h.ref), max(0.0, deadline - time.time()) + GRACE_S + CHECK_S + 10,
                 "the supervisor to destroy the VM")
        assert time.time() >= deadline
        assert sup.wait(10) == 0
        assert d.poll(h) == (FENCED, None)
    finally:
        close_vm_driver(d)


def test_a_supervisor_starts_on_the_standard_library_alone():
    """Every VM starts a supervisor process (and every process job its wrapper), so its start-up is node
    CPU per job: it loads no docker SDK, no requests and no pathlib (with fnmatch and urllib, a third of
    its imports)."""
    out = subprocess.run([sys.executable, "-c", "import sys, agents.supervisor.__main__, agents.supervisor as s; "
                          "print(len(s.SOURCE) > 0, *sorted(sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))).stdout.split()
    assert out[0] == "True"  # the process sandbox's job parent still reads lease.py's text
    assert not {"docker", "requests", "urllib3", "pathlib", "fnmatch"} & set(out[1:])


def test_a_process_jobs_supervisor_imports_no_json_re_subprocess_or_enum(tmp_path):
    """The process sandbox's job parent (lease.py's text under ``python -I -S``) runs once per job: it
    reads the lease without json (and the re it imports), starts the job without subprocess and names
    signals without enum, each a measurable share of its start-up."""
    from agents.supervisor import SOURCE

    write_lease(tmp_path / "lease", time.time() + 60, 3.0)
    probe = "import atexit, sys\natexit.register(lambda: print(*sorted(sys.modules), file=sys.stderr))\n" + SOURCE
    out = subprocess.run([sys.executable, "-I", "-S", "-c", probe, "process", str(tmp_path / "exit"),
                          str(tmp_path / "lease"), "60", "3", "--", "sh", "-c", "exit 3"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and (tmp_path / "exit").read_text() == "3\n"
    assert not {"json", "re", "subprocess", "threading", "enum", "site"} & set(out.stderr.split())


@pytest.mark.parametrize("text, read", [
    ('{"deadline": 1750000000.25, "fence_grace_s": 3.0}', (1750000000.25, 3.0)),
    ('{"fence_grace_s": 5, "deadline": 12}\n', (12.0, 5.0)),
    ('{"deadline": 1750000000.25}', None),  # no grace: a half-written or foreign file keeps the last
    ('{"deadline": "soon", "fence_grace_s": 3}', None),
    ('{"deadline": 1, "fence_grace_s": 3', None),
    ('', None),
    ('[1, 2]', None),
])
def test_the_lease_file_is_read_without_json(tmp_path, text, read):
    (tmp_path / "lease").write_text(text)
    assert read_lease(tmp_path / "lease") == read


def test_the_lease_file_is_written_again_only_when_the_lease_moves(tmp_path):
    """Each launch asks for the lease file (its supervisor reads it from its start); a node's launches
    of one pass between two renewals write it, and fsync it, once."""
    driver = ProcessDriver(node="leasefile", state_dir=str(tmp_path))
    client = PortalClient("http://127.0.0.1:9", TOKEN, timeout_s=1, retries=0)
    agent = Agent(name="leasefile", client=client, driver=driver, probe=SimProbe("1xH100-80GB", node_name="leasefile"))
    client.lease_renewed_at = time.monotonic()
    agent.write_lease()
    first = os.stat(driver.lease_path).st_ino  # each write replaces the file
    for _ in range(3):
        agent.write_lease()
    assert os.stat(driver.lease_path).st_ino == first
    client.lease_renewed_at += 5  # a heartbeat renewed it: the deadline moves 5 s on
    before = read_lease(driver.lease_path)[0]
    agent.write_lease()
    assert os.stat(driver.lease_path).st_ino != first
    assert abs(read_lease(driver.lease_path)[0] - (before + 5)) < 0.5
    os.unlink(driver.lease_path)  # gone behind its back: written again
    agent.write_lease()
    assert read_lease(driver.lease_path) is not None
