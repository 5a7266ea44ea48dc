"""Many jobs ending together: their end reports go up in one request (protocol 1.2), each still
reported once, after its log tail, and dropped when the portal calls it stale; a portal before 1.2,
or one that refuses the batch, gets them one by one."""

import threading

import pytest

from agents.client import PortalError
from agents.probe.sim import SimProbe
from agents.protocol import EVENTS_MAX
from agents.worker import Agent
from tests.agents.fakes import Clock, FakeDriver, FakePortal

SPEC = {"image": "gpuportal/busybox:latest", "command": ["true"], "cpus": 1, "memory_mb": 64, "time_limit_s": 600}


@pytest.fixture
def env():
    clock, wall = Clock(), Clock(1000.0)
    portal, driver = FakePortal(clock), FakeDriver()
    agent = Agent(name="n1", client=portal, driver=driver, probe=SimProbe("4xH100-80GB", node_name="n1", clock=wall),
                  stop_grace_s=0.0, background=False, clock=clock, wall=wall)
    agent.register()
    return type("Env", (), dict(portal=portal, driver=driver, agent=agent))


def launch_and_end(env, codes: dict[str, int]) -> None:
    for job_id in codes:
        assert env.agent.launch(job_id, 1, SPEC) == "started"
    for job_id, code in codes.items():
        env.driver.by_job(job_id)["log"] = f"{job_id} done\n".encode()
        env.driver.exit(job_id, code)


def ends(env):
    return sorted((j, a, s, c) for j, a, s, c, _ in env.portal.events if s not in ("starting", "running"))


def test_jobs_ending_together_are_reported_in_one_request_after_their_log_tails(env):
    launch_and_end(env, {"a": 0, "b": 3, "c": 0})
    env.agent.supervise_once()
    assert env.portal.batches == [[("a", 1, "succeeded"), ("b", 1, "failed"), ("c", 1, "succeeded")]]
    assert ends(env) == [("a", 1, "succeeded", 0), ("b", 1, "failed", 3), ("c", 1, "succeeded", 0)]
    assert [env.portal.log_text(j) for j in "abc"] == ["a done\n", "b done\n", "c done\n"]
    assert env.agent.jobs() == {} and env.driver.sandboxes == {}
    env.agent.supervise_once()  # nothing is reported twice
    assert len(env.portal.batches) == 1 and len(ends(env)) == 3


def test_one_end_alone_goes_as_a_single_report(env):
    launch_and_end(env, {"a": 0})
    env.agent.supervise_once()
    assert env.portal.batches == [] and ends(env) == [("a", 1, "succeeded", 0)]


def test_more_ends_than_a_batch_holds_go_in_several(env):
    codes = {f"j{i}": 0 for i in range(EVENTS_MAX + 5)}
    launch_and_end(env, codes)
    env.agent.supervise_once()
    assert [len(b) for b in env.portal.batches] == [EVENTS_MAX, 5]
    assert len(ends(env)) == EVENTS_MAX + 5 and env.agent.jobs() == {}


def test_a_stale_report_in_a_batch_is_dropped_and_its_sandbox_removed(env):
    launch_and_end(env, {"a": 0, "b": 0})
    env.portal.stale.add(("b", 1))  # the portal moved b on (cancelled and requeued, say)
    env.agent.supervise_once()
    assert ends(env) == [("a", 1, "succeeded", 0)]
    assert env.agent.jobs() == {} and env.driver.sandboxes == {}


def test_an_unreachable_portal_keeps_every_end_for_the_next_pass(env):
    launch_and_end(env, {"a": 0, "b": 1})
    env.portal.unreachable = True
    env.agent.supervise_once()
    assert ends(env) == [] and set(env.agent.jobs()) == {("a", 1), ("b", 1)}
    env.portal.unreachable = False
    env.agent.supervise_once()
    assert ends(env) == [("a", 1, "succeeded", 0), ("b", 1, "failed", 1)] and env.agent.jobs() == {}


def test_a_refused_batch_is_sent_one_by_one(env):
    """The portal refuses the batch (one report in it is bad): each report then goes alone, where a
    refused one is sent shorter next pass and the others are taken at once."""
    launch_and_end(env, {"a": 0, "b": 1})
    env.portal.refuse_events = 2  # the batch, then a's single report
    env.agent.supervise_once()
    assert ends(env) == [("b", 1, "failed", 1)] and set(env.agent.jobs()) == {("a", 1)}
    env.agent.supervise_once()
    assert ends(env) == [("a", 1, "succeeded", None), ("b", 1, "failed", 1)] and env.agent.jobs() == {}


def test_a_portal_before_protocol_1_2_gets_single_reports(env):
    env.portal.register = lambda **body: {"node": 7, "heartbeat_interval_s": 5, "lease_s": 30, "protocol_version": "1.1"}
    env.agent.register()
    launch_and_end(env, {"a": 0, "b": 0})
    env.agent.supervise_once()
    assert env.portal.batches == [] and len(ends(env)) == 2


def test_a_portal_answering_404_to_batches_gets_single_reports_from_then_on(env):
    def no_batches(reports):
        raise PortalError("POST /events: HTTP 404: not found", 404)

    env.portal.event_batch = no_batches
    launch_and_end(env, {"a": 0, "b": 0})
    env.agent.supervise_once()
    assert len(ends(env)) == 2 and env.agent.batch_events is False


def test_ends_of_stops_made_on_stop_threads_go_up_together_through_the_supervisors_pass(env):
    """A stop runs on its own thread; with the supervisor's loop running, the thread hands the end to
    it instead of reporting it alone, so many stops together (a cancelled array, a fence) make one request."""
    env.agent.background = True
    env.agent._supervising = True  # as while run_supervisor's loop runs
    for job_id in "abc":
        assert env.agent.launch(job_id, 1, SPEC) == "started"
    for job_id in "abc":
        assert env.agent.stop(job_id, 1, "cancelled by its owner", wait=False)
    env.agent.join_stops()
    assert ends(env) == [] and env.agent._ended == {t.handle.ref for t in env.agent.jobs().values()}
    env.agent.supervise_once(only=set(env.agent._ended))
    assert env.portal.batches == [[("a", 1, "cancelled"), ("b", 1, "cancelled"), ("c", 1, "cancelled")]]
    assert env.agent.jobs() == {} and env.driver.sandboxes == {}


def test_a_stop_with_no_supervisor_loop_reports_its_end_itself(env):
    env.agent.background = True
    assert env.agent.launch("a", 1, SPEC) == "started"
    assert env.agent.stop("a", 1, "cancelled by its owner", wait=False)
    env.agent.join_stops()
    assert ends(env) == [("a", 1, "cancelled", 143)] and env.agent.jobs() == {} and env.portal.batches == []


def test_reports_queued_while_one_is_in_flight_go_up_together_in_the_next_request():
    """GroupSender: the first report goes at once; those that come while it is in flight wait for it and
    then go in one request, each answered with its own outcome."""
    import threading

    from agents.worker import GroupSender
    from tests.procs import wait_for

    sent, first_in_flight, release = [], threading.Event(), threading.Event()

    def send_many(reports):
        sent.append([r["job_id"] for r in reports])
        if len(sent) == 1:
            first_in_flight.set()
            release.wait(10)
        return ["stale" if r["job_id"] == "c" else "applied" for r in reports]

    sender = GroupSender(send_many)
    outcomes = {}
    threads = [threading.Thread(target=lambda j=j: outcomes.__setitem__(j, sender.send({"job_id": j})))
               for j in "abcd"]
    threads[0].start()
    assert first_in_flight.wait(10)
    for th in threads[1:]:
        th.start()
    wait_for(lambda: len(sender._queue) == 3, 10, "three reports queued behind the first")
    release.set()
    for th in threads:
        th.join(10)
    assert sent[0] == ["a"] and sorted(sent[1]) == ["b", "c", "d"] and len(sent) == 2
    assert outcomes == {"a": "applied", "b": "applied", "c": "stale", "d": "applied"}


def test_a_group_announced_with_gather_goes_up_in_one_request_and_a_short_one_waits_only_the_bound():
    """GroupSender.gather(n): the first report waits for the other n - 1 (a node's launches of one
    pass confirming), so they share one request; when fewer come, it goes once the bound is up."""
    import threading
    import time

    from agents.worker import GroupSender

    sent = []
    sender = GroupSender(lambda reports: sent.append(sorted(r["job_id"] for r in reports)) or ["ok"] * len(reports))

    def send_all(ids, stagger_s=0.0):
        threads = [threading.Thread(target=sender.send, args=({"job_id": j},)) for j in ids]
        for th in threads:
            th.start()
            time.sleep(stagger_s)  # the launches' threads come a little apart, as a pool starts them
        for th in threads:
            th.join(10)

    sender.gather(4, within_s=10)
    send_all("abcd", stagger_s=0.02)
    assert sent == [["a", "b", "c", "d"]]

    del sent[:]
    sender.gather(3, within_s=0.3)  # one of three never reports (its launch failed)
    t0 = time.monotonic()
    send_all("xy")
    took = time.monotonic() - t0
    assert sent == [["x", "y"]] and 0.25 <= took < 5

    del sent[:]
    send_all("z")  # nothing announced: it goes at once
    assert sent == [["z"]]


class EndingDriver(FakeDriver):
    """A sandbox that has ended by the time its launch returns (`true`), its end seen by the watcher."""

    def __init__(self):
        super().__init__()
        self.agent = None
        self.ends_at_once: set[str] = set()

    def launch(self, spec):
        h = super().launch(spec)
        if spec.job_id in self.ends_at_once:
            self.exit(spec.job_id, 0)
            self.agent.sandbox_ended(h.ref)
        return h


@pytest.fixture
def holding():
    clock, wall = Clock(), Clock(1000.0)
    portal, driver = FakePortal(clock), EndingDriver()
    agent = Agent(name="n1", client=portal, driver=driver, probe=SimProbe("4xH100-80GB", node_name="n1", clock=wall),
                  stop_grace_s=0.0, background=False, clock=clock, wall=wall, running_hold_s=0.05)
    driver.agent = agent
    agent.register()
    return type("Env", (), dict(portal=portal, driver=driver, agent=agent))


def test_a_job_ending_while_its_launch_holds_running_sends_both_in_one_request(holding):
    holding.driver.ends_at_once.add("a")
    assert holding.agent.launch("a", 1, SPEC) == "started"
    assert holding.portal.states("a") == ["starting"]  # no `running` request of its own
    holding.agent.supervise_once()
    assert holding.portal.batches == [[("a", 1, "running"), ("a", 1, "succeeded")]]
    assert holding.portal.states("a") == ["starting", "running", "succeeded"]
    assert holding.agent.jobs() == {}


def test_a_job_still_running_after_the_hold_reports_running_then_its_end_alone(holding):
    assert holding.agent.launch("b", 1, SPEC) == "started"
    assert holding.portal.states("b") == ["starting", "running"] and holding.portal.batches == []
    holding.driver.exit("b", 0)
    holding.agent.supervise_once()
    assert holding.portal.batches == [] and holding.portal.states("b") == ["starting", "running", "succeeded"]


def test_a_carried_running_report_goes_again_with_its_end_after_an_outage(holding):
    holding.driver.ends_at_once.add("a")
    assert holding.agent.launch("a", 1, SPEC) == "started"
    holding.portal.unreachable = True
    holding.agent.supervise_once()
    assert holding.portal.states("a") == ["starting"] and set(holding.agent.jobs()) == {("a", 1)}
    holding.portal.unreachable = False
    holding.agent.supervise_once()
    assert holding.portal.batches[-1] == [("a", 1, "running"), ("a", 1, "succeeded")]
    assert holding.portal.states("a") == ["starting", "running", "succeeded"] and holding.agent.jobs() == {}


def test_many_carried_running_reports_still_fit_the_batch_limit(holding):
    codes = {f"j{i}": 0 for i in range(EVENTS_MAX // 2 + 3)}
    holding.driver.ends_at_once.update(codes)
    for job_id in codes:
        assert holding.agent.launch(job_id, 1, SPEC) == "started"
    holding.agent.supervise_once()
    assert [len(b) for b in holding.portal.batches] == [EVENTS_MAX, 6]
    assert len(ends(holding)) == len(codes) and holding.agent.jobs() == {}


def test_an_end_seen_while_running_is_in_flight_waits_for_it_without_holding_up_the_supervisor(holding):
    """The launch is still sending `running` (a slow portal) when the job ends: the supervisor's pass
    neither blocks on it nor reports the end before it; once `running` is in, the end follows."""
    entered, release = threading.Event(), threading.Event()
    event = holding.portal.event

    def slow_running(job_id, attempt, state, **kw):
        if state == "running":
            entered.set()
            assert release.wait(10)
        return event(job_id, attempt, state, **kw)

    holding.portal.event = slow_running
    launching = threading.Thread(target=holding.agent.launch, args=("a", 1, SPEC))
    launching.start()
    try:
        assert entered.wait(10)
        holding.driver.exit("a", 0)
        passed = threading.Thread(target=holding.agent.supervise_once)
        passed.start()
        passed.join(5)
        assert not passed.is_alive()  # the pass did not wait for the `running` request
        assert holding.portal.states("a") == ["starting"] and set(holding.agent.jobs()) == {("a", 1)}
    finally:
        release.set()
        launching.join(10)
    assert "sbx-1" in holding.agent._ended  # the launch woke the supervisor for the end it held up
    holding.agent.supervise_once()
    assert holding.portal.states("a") == ["starting", "running", "succeeded"] and holding.agent.jobs() == {}
