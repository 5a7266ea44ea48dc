"""The agent's lease through the portal's own outages, with the real HTTP client, a portal
stub on 127.0.0.1 and the process sandbox (docs/agent.md, "Lease")."""

import time

import pytest

from agents.client import PortalClient, PortalUnreachable
from agents.probe.sim import SimProbe
from agents.sandbox import RUNNING
from agents.sandbox.process_driver import ProcessDriver
from agents.worker import Agent
from tests.agents.conftest import running_agent
from tests.agents.fakes import Clock, FakeDriver, FakePortal
from tests.agents.portal_stub import TOKEN, PortalStub
from tests.procs import wait_for

JOB = {"image": "busybox", "command": ["sleep", "120"], "cpus": 1, "memory_mb": 64, "time_limit_s": 300}
LEASE_S = 2.0


@pytest.fixture
def live(tmp_path, request):
    """A real agent (client, process driver, heartbeat and supervisor threads) with a 2 s lease; the
    fixture's param is the client's slow_is_outage (default on)."""
    stub = PortalStub()
    client = PortalClient(stub.url, TOKEN, timeout_s=2, retries=0, slow_is_outage=getattr(request, "param", True))
    driver = ProcessDriver(node="lease", state_dir=str(tmp_path))
    try:
        with running_agent("lease", client, driver, lease_s=LEASE_S) as agent:
            yield type("Live", (), dict(stub=stub, agent=agent, driver=driver))
    finally:
        stub.close()


def running(live, job_id):
    return any(j == job_id and live.driver.poll(h)[0] == RUNNING for j, _, h in live.driver.list_own())


def runs_on_through_three_leases(live, job_id):
    """Watches the job for three leases: it must run, and the agent not fence, the whole time."""
    t_end = time.monotonic() + 3 * LEASE_S
    while time.monotonic() < t_end:
        assert running(live, job_id) and not live.agent.fenced
        time.sleep(0.1)


def test_job_keeps_running_while_the_portal_answers_503_longer_than_the_lease(live):
    assert live.agent.launch("j1", 1, JOB) == "started"
    live.stub.outage = True  # its database is out: every request answers 503 + X-Gpuportal-Outage
    runs_on_through_three_leases(live, "j1")
    assert live.agent.client.portal_outage == "database"
    live.stub.outage = False
    wait_for(lambda: live.agent.client.portal_outage == "", 5, "the portal to answer again")
    assert running(live, "j1")
    assert live.stub.calls("/jobs/j1/confirm") and [c["state"] for c in live.stub.calls("/jobs/j1/events")] == ["running"]


def test_job_keeps_running_while_the_portal_refuses_connections_longer_than_the_lease(live):
    """Every portal process restarted at once: nothing listens on its port for a while. The agent
    renews its lease (and the lease file its jobs' supervisors read) on each refusal."""
    assert live.agent.launch("j1", 1, JOB) == "started"
    live.stub.stop_listening()
    runs_on_through_three_leases(live, "j1")
    assert live.agent.client.portal_outage.startswith("web")
    live.stub.listen()
    wait_for(lambda: live.agent.client.portal_outage == "", 5, "the portal to answer again")
    assert running(live, "j1")


def test_job_keeps_running_while_the_portal_takes_connections_and_answers_none_longer_than_the_lease(live):
    """A frozen or overloaded portal (its workers SIGSTOPped, its queue long): connections are accepted,
    nothing is answered for three leases. Before each deadline the lease check finds a request unanswered and
    the portal's host still accepting connections, and renews the lease (and the lease file): the job runs on.
    The requests taken meanwhile are answered late, and the agent carries on."""
    assert live.agent.launch("j1", 1, JOB) == "started"
    live.stub.freeze()
    runs_on_through_three_leases(live, "j1")
    assert live.agent.client.portal_outage.startswith("web (slow")
    before = len(live.stub.calls("/heartbeat"))
    live.stub.thaw()
    wait_for(lambda: live.agent.client.portal_outage == "" and len(live.stub.calls("/heartbeat")) > before + 1, 10,
             "the portal to answer again")
    assert running(live, "j1") and not live.agent.fenced


@pytest.mark.parametrize("live", [False], indirect=True)
def test_a_frozen_portal_is_silence_with_slow_is_outage_off(live):
    """The control: with slow_is_outage off, the same freeze runs the lease out and the job is stopped."""
    assert live.agent.launch("j1", 1, JOB) == "started"
    live.stub.freeze()
    wait_for(lambda: not running(live, "j1"), LEASE_S + 5, "the lease to stop the job")
    # The job's supervisor may stop it first (it reads the lease file as often as the agent checks):
    # the agent fences within its next check.
    wait_for(lambda: live.agent.fenced, 5, "the agent to fence")
    live.stub.thaw()


@pytest.mark.parametrize("live", [False], indirect=True)
def test_silence_past_the_lease_stops_the_job(live):
    """The control: with slow_is_outage off a 502 without the outage header is silence, and the lease fences."""
    assert live.agent.launch("j1", 1, JOB) == "started"
    t0 = time.monotonic()
    live.stub.fail_next = [502] * 10_000
    wait_for(lambda: not running(live, "j1"), LEASE_S + 5, "the lease to stop the job")
    assert time.monotonic() - t0 >= LEASE_S - 0.5
    wait_for(lambda: live.agent.fenced, 5, "the agent to fence")  # its supervisor may have stopped it first
    live.stub.fail_next = []
    wait_for(lambda: "failed" in [c["state"] for c in live.stub.calls("/jobs/j1/events")], 10,
             "the fenced job's report")
    # Whichever stopped it first, the agent's fence or the job's own supervisor reading the lease
    # file, the report names the lease, never a plain exit.
    message = live.stub.calls("/jobs/j1/events")[-1]["message"]
    assert "portal unreachable" in message or "its lease ran out" in message, message


def _leased(portal, driver, clock, wall) -> Agent:
    """A registered agent on fake clocks with a 15 s lease and a 3 s fence grace (the stop grace 10 s)."""
    agent = Agent(name="n1", client=portal, driver=driver, probe=SimProbe("2xH100-80GB", node_name="n1", clock=wall),
                  stop_grace_s=10.0, background=False, clock=clock, wall=wall)
    agent.register()
    agent.lease_s, agent.fence_grace_s = 15.0, 3.0
    return agent


class HeartbeatsLost(FakePortal):
    def heartbeat(self, *, samples, jobs):
        raise PortalUnreachable("heartbeat lost (fake)")


def test_log_and_event_calls_do_not_renew_the_lease():
    """The portal's reaper counts heartbeats only: a node whose heartbeats are lost is reaped even
    though its logs still arrive, so the agent must fence on heartbeats alone."""
    clock, wall = Clock(), Clock(1000.0)
    portal = HeartbeatsLost(clock)
    driver = FakeDriver()
    agent = _leased(portal, driver, clock, wall)
    agent.launch("j1", 1, {**JOB, "gpu_indexes": [0]})
    for _ in range(4):  # 20 s of successful log shipping, no heartbeat answered
        clock.t += 5
        agent.supervise_once()
        agent.heartbeat_once()
    assert driver.running() == [] and agent.fenced
    assert driver.stopped[-1][2] == 3.0  # the fence grace, not the 10 s stop grace


def test_a_heartbeat_retrying_through_an_outage_keeps_the_lease_file_fresh(tmp_path):
    """One heartbeat call retries for twice the lease while the portal gives its outage answer: each
    answer renews the lease and reaches the node's lease file at once (not when the call gives up),
    so the jobs' supervisors never fence them. A 5 s lease, not LEASE_S: under the whole suite one
    answer (a fsync of the lease file with it) once took over 2 s, and the lease lapsed between two."""
    lease_s = 5.0
    stub = PortalStub()
    client = PortalClient(stub.url, TOKEN, timeout_s=2, retries=40, backoff_s=0.3, max_backoff_s=0.3)
    driver = ProcessDriver(node="retry", state_dir=str(tmp_path))
    agent = Agent(name="retry", client=client, driver=driver, probe=SimProbe("1xH100-80GB", node_name="retry"),
                  stop_grace_s=1.0, scrub_gpus=False)
    try:
        agent.register()
        agent.lease_s, agent.fence_grace_s = lease_s, 0.5
        assert agent.launch("j1", 1, JOB) == "started"
        stub.outage = True
        t0 = time.monotonic()
        with pytest.raises(PortalUnreachable):
            client.heartbeat(samples=[], jobs=[])
        assert time.monotonic() - t0 > 2 * lease_s
        assert running(type("Live", (), dict(driver=driver)), "j1")
    finally:
        for _, _, handle in driver.list_own():
            driver.stop(handle, 0)
            driver.remove(handle)
        stub.close()


class SlowStart(FakeDriver):
    """A sandbox engine whose start outlasts what was left of the lease, the portal silent meanwhile."""

    def __init__(self, clock, portal):
        super().__init__()
        self.clock, self.portal, self.agent = clock, portal, None

    def launch(self, spec):
        handle = super().launch(spec)
        self.portal.unreachable = True
        self.clock.t += 20  # past the 15 s lease
        self.agent.check_lease()  # the lease thread fences meanwhile: no job is tracked yet
        return handle


def test_a_sandbox_whose_start_outlasts_the_lease_is_stopped_as_the_fence_stops_the_others():
    clock, wall = Clock(), Clock(1000.0)
    portal = FakePortal(clock)
    driver = SlowStart(clock, portal)
    agent = driver.agent = _leased(portal, driver, clock, wall)
    clock.t += 5  # confirmed within the lease
    assert agent.launch("j1", 1, {**JOB, "gpu_indexes": [0]}) == "started"
    assert agent.fenced and driver.running() == []
    assert driver.stopped == [("j1", 1, 3.0)]  # the fence grace
    portal.unreachable = False
    agent.supervise_once()
    assert ("j1", 1) in portal.lease_expired  # reported as the lease's doing: the portal requeues, never fails it


class SlowPortal(HeartbeatsLost):
    """Heartbeats unanswered, the portal's host accepting connections: renew_if_slow renews, as PortalClient's."""

    def __init__(self, clock):
        super().__init__(clock)
        self.probes = 0

    def renew_if_slow(self):
        self.probes += 1
        self.lease_renewed_at = self.clock()
        return True


def test_a_slow_portal_renews_the_lease_before_its_deadline_but_never_revives_one_run_out():
    """The lease check asks renew_if_slow only in the last seconds before the deadline: there a slow portal
    extends the lease. An agent frozen through that window (its lease already out when it checks again) fences
    without asking: the portal may have reaped the node meanwhile, and the jobs' supervisors have fenced."""
    clock, wall = Clock(), Clock(1000.0)
    portal = SlowPortal(clock)
    driver = FakeDriver()
    agent = _leased(portal, driver, clock, wall)
    agent.launch("j1", 1, {**JOB, "gpu_indexes": [0]})
    renewed = portal.lease_renewed_at
    clock.t = renewed + 12.0  # 3 s before the deadline: not yet asked
    assert not agent.check_lease() and portal.probes == 0
    clock.t = renewed + 14.0  # within the last 2 s: asked, renewed from now
    assert not agent.check_lease() and portal.probes == 1 and portal.lease_renewed_at == clock.t
    clock.t += 15.5  # frozen past the renewed deadline in one step
    assert agent.check_lease() and portal.probes == 1 and driver.running() == []
