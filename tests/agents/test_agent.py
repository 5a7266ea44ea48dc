"""Agent logic with a fake portal and a fake sandbox driver: no Celery, no HTTP."""

import logging
import threading

import pytest

from agents.probe.sim import SimProbe
from agents.worker import Agent
from tests.agents.fakes import Clock, FakeDriver, FakePortal
from tests.procs import wait_for

SPEC = {"image": "gpuportal/busybox:latest", "command": ["sh", "-c", "train"], "cpus": 2,
        "memory_mb": 1024, "time_limit_s": 600, "gpu_indexes": [1, 2]}


@pytest.fixture
def env():
    clock, wall = Clock(), Clock(1000.0)
    portal, driver = FakePortal(clock), FakeDriver()
    probe = SimProbe("4xH100-80GB", node_name="n1", clock=wall)
    agent = Agent(name="n1", client=portal, driver=driver, probe=probe, stop_grace_s=0.0,
                  background=False, clock=clock, wall=wall)
    agent.register()
    return type("Env", (), dict(clock=clock, wall=wall, portal=portal, driver=driver, probe=probe, agent=agent))


def test_register_sends_inventory_and_takes_the_portals_timers(env):
    body = env.portal.registered
    assert body["name"] == "n1" and body["sandbox"] == "fake" and len(body["gpus"]) == 4
    assert set(body["gpus"][0]) == {"index", "uuid", "model", "memory_mb", "pci_bus_id", "topology"}
    assert env.agent.heartbeat_interval_s == 5 and env.agent.lease_s == 30 and env.agent.node_id == 7
    assert body["capabilities"] == {"mps": False, "simulated_gpus": True} and body["gpus_unusable"] == ""


def test_register_names_gpus_the_sandbox_cannot_serve(env):
    """A docker engine without the NVIDIA runtime: the registration says so, and the portal keeps
    GPU jobs away instead of sending launches that fail."""
    env.driver.gpu_problem = lambda: "Docker engine has no NVIDIA runtime"
    env.agent.register()
    assert env.portal.registered["gpus_unusable"] == "Docker engine has no NVIDIA runtime"


def test_launch_confirms_starts_and_reports(env):
    assert env.agent.launch("j1", 1, SPEC) == "started"
    assert env.portal.confirms == [("j1", 1)]
    assert env.portal.states("j1") == ["starting", "running"]
    (spec,) = env.driver.launched
    inv = env.probe.inventory()
    assert spec.gpu_uuids == [inv[1].uuid, inv[2].uuid] and spec.cpus == 2
    s = env.probe.sample()
    assert s[1].utilization > 0 and s[2].utilization > 0 and s[0].utilization == 0


def test_confirm_409_starts_nothing(env):
    env.portal.stale.add(("j1", 1))
    assert env.agent.launch("j1", 1, SPEC) == "stale"
    assert env.driver.launched == [] and env.portal.events == []


@pytest.mark.parametrize("replaced", [True, False])
def test_a_launch_that_outlived_its_lease_asks_again_before_starting(env, monkeypatch, replaced):
    """Confirmed, then frozen past the lease before the start: meanwhile the portal may have reaped the
    node, re-placed the job and taken the node back at its next heartbeat. The old confirmation no
    longer counts: the agent asks again, and starts nothing on a 409."""
    ready = env.agent._gpus_ready

    def frozen_then_back(ls):
        env.clock.t += 31  # past the 30 s lease
        env.portal.heartbeat(samples=[], jobs=[])  # back: the lease is renewed, the node is up again
        if replaced:
            env.portal.stale.add(("j1", 1))  # the job runs elsewhere as attempt 2 by now
        return ready(ls)
    monkeypatch.setattr(env.agent, "_gpus_ready", frozen_then_back)
    assert env.agent.launch("j1", 1, SPEC) == ("stale" if replaced else "started")
    # Asked again (a 409 is not recorded by the fake): without asking it would have started.
    assert env.portal.confirms == [("j1", 1)] * (1 if replaced else 2)
    assert [(s.job_id, s.attempt) for s in env.driver.launched] == ([] if replaced else [("j1", 1)])


def test_a_launch_within_its_lease_is_confirmed_once(env):
    assert env.agent.launch("j1", 1, SPEC) == "started"
    assert env.portal.confirms == [("j1", 1)]


def test_confirm_unreachable_starts_nothing_and_raises_for_retry(env):
    from agents.client import PortalUnreachable

    env.portal.unreachable = True
    with pytest.raises(PortalUnreachable):
        env.agent.launch("j1", 1, SPEC)
    assert env.driver.launched == []
    env.portal.unreachable = False
    assert env.agent.launch("j1", 1, SPEC) == "started"  # the retried task


def test_duplicate_launch_starts_nothing_twice(env):
    assert env.agent.launch("j1", 1, SPEC) == "started"
    assert env.agent.launch("j1", 1, SPEC) == "duplicate"
    assert len(env.driver.launched) == 1 and env.portal.confirms == [("j1", 1)]


def test_concurrent_duplicate_launches_start_one_sandbox(env):
    results = []
    gate = threading.Barrier(8)

    def go():
        gate.wait()
        results.append(env.agent.launch("j1", 1, SPEC))

    threads = [threading.Thread(target=go) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(results) == ["duplicate"] * 7 + ["started"]
    assert len(env.driver.launched) == 1


def test_confirmed_spec_wins_over_the_task_argument(env):
    env.portal.spec = {"memory_mb": 2048, "command": ["echo", "confirmed"]}
    env.agent.launch("j1", 1, SPEC)
    (spec,) = env.driver.launched
    assert spec.memory_mb == 2048 and spec.command == ["echo", "confirmed"] and spec.cpus == 2


def test_newer_attempt_stops_the_older_one(env):
    env.agent.launch("j1", 1, SPEC)
    env.agent.launch("j1", 2, SPEC)
    assert ("j1", 1, 143, "superseded by attempt 2") in [(e[0], e[1], e[3], e[4]) for e in env.portal.events]
    assert env.driver.running() == [("j1", 2)]


def test_success_ships_logs_then_reports_and_removes(env):
    env.agent.launch("j1", 1, SPEC)
    sbx = env.driver.by_job("j1")
    sbx["log"] = b"epoch 1\n"
    env.agent.supervise_once()
    sbx["log"] += b"epoch 2\ndone\n"
    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    assert env.portal.log_text("j1") == "epoch 1\nepoch 2\ndone\n"
    assert [lg[2] for lg in env.portal.log_chunks] == [0, 8]  # offsets
    assert env.portal.events[-1] == ("j1", 1, "succeeded", 0, "")
    assert env.driver.sandboxes == {} and env.agent.jobs() == {}
    assert env.probe.sample()[1].utilization == 0  # GPU idle again


@pytest.mark.parametrize("how,state,code", [("fail", "failed", 3), ("oom", "oom", 137)])
def test_failure_and_oom_are_reported_with_exit_code(env, how, state, code):
    env.agent.launch("j1", 1, SPEC)
    env.driver.oom("j1") if how == "oom" else env.driver.exit("j1", 3)
    env.agent.supervise_once()
    assert env.portal.events[-1][2:4] == (state, code)


def test_time_limit_gives_timeout(env):
    env.agent.launch("j1", 1, SPEC)  # fake handles start at wall time 1000, limit 600 s
    env.wall.t = 1599
    env.agent.supervise_once()
    assert env.driver.stopped == []
    env.wall.t = 1601
    env.agent.supervise_once()
    assert env.driver.stopped == [("j1", 1, 0.0)]
    j, a, state, code, msg = env.portal.events[-1]
    assert state == "timeout" and code == 143 and "time limit of 600s" in msg


def test_stop_command_terms_and_reports_cancelled(env):
    env.agent.launch("j1", 1, SPEC)
    assert env.agent.stop("j1", 1, "cancelled by alice", grace_s=5) is True
    assert env.driver.stopped == [("j1", 1, 5.0)]
    assert env.portal.events[-1] == ("j1", 1, "cancelled", 143, "cancelled by alice")
    assert env.agent.stop("j1", 1, "again") is False  # gone: nothing to stop


def test_stale_running_report_stops_the_sandbox(env):
    # Stale only after confirm: the portal moved on between confirm and the running report.
    orig = env.portal.event

    def event(job_id, attempt, state, **kw):
        if state == "running" and job_id == "j1":
            env.portal.stale.add(("j1", 1))
        return orig(job_id, attempt, state, **kw)

    env.portal.event = event
    env.agent.launch("j1", 1, SPEC)
    assert ("j1", 1) not in env.driver.running() and ("j1", 1) in [s[:2] for s in env.driver.stopped]
    assert ("j1", 1) not in env.agent.jobs()


def test_stale_log_upload_stops_the_sandbox(env):
    env.agent.launch("j1", 1, SPEC)
    env.driver.by_job("j1")["log"] = b"x\n"
    env.portal.stale.add(("j1", 1))
    env.agent.supervise_once()
    assert env.driver.stopped and env.agent.jobs() == {}


def test_heartbeat_reports_jobs_and_obeys_the_stop_list(env):
    env.agent.launch("j1", 1, SPEC)
    env.agent.launch("j2", 1, {**SPEC, "gpu_indexes": [3]})
    env.portal.stop_list = [{"job_id": "j2", "attempt": 1, "reason": "preempted"}]
    env.agent.heartbeat_once()
    hb = env.portal.heartbeats[-1]
    assert sorted((j["job_id"], j["state"]) for j in hb["jobs"]) == [("j1", "running"), ("j2", "running")]
    assert len(hb["samples"]) == 4 and hb["samples"][1]["gpu_uuid"] == env.probe.inventory()[1].uuid
    assert env.driver.running() == [("j1", 1)]
    assert env.portal.events[-1][:3] == ("j2", 1, "cancelled") and env.portal.events[-1][4] == "preempted"


def test_reconcile_adopts_labelled_sandboxes_and_stops_stale_ones(env):
    env.driver.add_existing("old", 1, gpu_indexes=[0])
    env.driver.add_existing("stale", 4, gpu_indexes=[3])
    assert sorted(env.agent.reconcile()) == [("old", 1), ("stale", 4)]
    env.portal.stop_list = [{"job_id": "stale", "attempt": 4, "reason": "attempt 5 runs elsewhere"}]
    env.agent.heartbeat_once()
    reported = {(j["job_id"], j["attempt"]) for j in env.portal.heartbeats[-1]["jobs"]}
    assert reported == {("old", 1), ("stale", 4)}
    assert env.driver.running() == [("old", 1)]
    # A launch for an adopted attempt (task redelivered after the restart) starts nothing.
    assert env.agent.launch("old", 1, SPEC) == "duplicate" and env.driver.launched == []
    env.agent.supervise_once()
    assert env.portal.log_text("old") == "old output\n"  # re-shipped from offset 0


def test_lease_expiry_stops_every_sandbox_and_says_so(env, caplog):
    env.agent.launch("j1", 1, SPEC)
    env.agent.launch("j2", 1, {**SPEC, "gpu_indexes": [3]})
    env.portal.unreachable = True
    env.clock.t += 25
    env.agent.heartbeat_once()
    assert env.driver.running() == [("j1", 1), ("j2", 1)]  # within the 30 s lease
    env.clock.t += 10
    with caplog.at_level(logging.ERROR):
        env.agent.heartbeat_once()
    assert "LEASE EXPIRED" in caplog.text
    assert env.driver.running() == [] and env.agent.fenced
    # The reports wait (with the sandboxes, for their logs) until the portal is back.
    assert set(env.agent.jobs()) == {("j1", 1), ("j2", 1)}
    env.portal.unreachable = False
    env.agent.heartbeat_once()
    assert not env.agent.fenced
    env.agent.supervise_once()
    assert env.agent.jobs() == {}
    finals = [e for e in env.portal.events if e[2] == "failed"]
    assert len(finals) == 2 and "portal unreachable" in finals[0][4]
    # Said to be the lease's doing: the portal requeues them as a node fault, not the jobs' failure.
    assert sorted(env.portal.lease_expired) == [("j1", 1), ("j2", 1)]


def test_supervisor_checks_the_lease_even_when_heartbeats_hang(env):
    env.agent.launch("j1", 1, SPEC)
    env.portal.unreachable = True
    env.clock.t += 31
    env.agent.supervise_once()
    assert env.driver.running() == []


def test_the_lease_thread_fences_while_a_supervisor_pass_is_stuck(env, monkeypatch):
    """A supervisor pass blocked on the portal (a log upload into dropped packets retries for tens of
    seconds) must not hold up the fence: the lease has a thread of its own."""
    env.agent.launch("j1", 1, SPEC)
    stuck = threading.Event()
    monkeypatch.setattr(env.driver, "read_logs", lambda handle, offset: stuck.wait(30) and b"")
    stop = threading.Event()
    threads = [threading.Thread(target=env.agent.supervise_once, daemon=True),
               threading.Thread(target=env.agent.run_lease_checks, args=(stop,), kwargs={"interval_s": 0.05},
                                daemon=True)]
    threads[0].start()
    env.portal.unreachable = True
    env.clock.t += 31
    threads[1].start()
    try:
        wait_for(lambda: env.driver.running() == [], 10, "the lease thread to stop the sandbox")
        assert env.agent.fenced and threads[0].is_alive()  # the pass is still stuck
    finally:
        stuck.set()
        stop.set()
        for th in threads:
            th.join(10)


def test_terminal_report_is_retried_until_the_portal_takes_it(env):
    env.agent.launch("j1", 1, SPEC)
    env.driver.by_job("j1")["log"] = b"tail\n"
    env.driver.exit("j1", 0)
    env.portal.unreachable = True
    env.agent.supervise_once()
    assert ("j1", 1) in env.agent.jobs() and env.driver.sandboxes  # kept, logs still readable
    env.portal.unreachable = False
    env.agent.supervise_once()
    assert env.portal.states("j1")[-1] == "succeeded" and env.portal.log_text("j1") == "tail\n"
    assert env.agent.jobs() == {}


def test_sandbox_error_is_reported_as_failed(env):
    env.driver.fail_with = "this node's Docker engine has no NVIDIA GPU support"
    assert env.agent.launch("j1", 1, SPEC) == "failed"
    assert env.portal.events[-1][2] == "failed" and "no NVIDIA GPU support" in env.portal.events[-1][4]


def test_bad_gpu_in_spec_is_reported_as_failed(env):
    assert env.agent.launch("j1", 1, {**SPEC, "gpu_indexes": [9]}) == "failed"
    assert "no GPU 9" in env.portal.events[-1][4] and env.driver.launched == []


def test_stop_that_overtakes_its_launch_is_applied(env):
    orig = env.portal.confirm

    def confirm(job_id, attempt):
        assert env.agent.stop(job_id, attempt, "cancelled early") is True
        return orig(job_id, attempt)

    env.portal.confirm = confirm
    env.agent.launch("j1", 1, SPEC)
    assert env.driver.running() == [] and env.portal.events[-1][2:] == ("cancelled", None, "cancelled early")
    # A GPU job notices the stop before its sandbox exists; a CPU job's sandbox starts and is stopped.
    assert env.driver.launched == []
    env.agent.launch("j2", 1, {**SPEC, "gpu_indexes": []})
    assert env.driver.running() == [] and env.portal.events[-1][2] == "cancelled"


def test_logs_ship_raw_bytes_whatever_the_job_printed(env):
    """NUL, invalid UTF-8 and characters cut at a chunk boundary reach the portal byte for byte."""
    env.agent.log_chunk_bytes = 5
    env.agent.launch("j1", 1, SPEC)
    raw = "héllo ✓ 日本\n".encode() + b"nul\x00 bad\xff\xfe\x80 end\n"
    env.driver.by_job("j1")["log"] = raw
    env.agent.supervise_once()
    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    assert env.portal.log_bytes("j1") == raw
    assert env.portal.states("j1")[-1] == "succeeded"


def _past_time_limit(env):
    env.wall.t = 1000.0 + SPEC["time_limit_s"] + 1


def test_a_refused_log_chunk_never_skips_the_time_limit(env):
    """The portal answering 400 to a log chunk (once: a job printed NUL) must not let the job run
    on: the time limit is enforced in the same pass, and the job ends timeout, its sandbox gone."""
    env.agent.launch("j1", 1, SPEC)
    env.driver.by_job("j1")["log"] = b"\x00" * 10
    env.portal.refuse_logs = 1000
    env.agent.supervise_once()
    assert env.driver.running() == [("j1", 1)] and env.portal.states("j1") == ["starting", "running"]
    _past_time_limit(env)
    env.agent.supervise_once()
    assert env.driver.running() == [] and env.driver.stopped[0][:2] == ("j1", 1)
    # The refused chunk is retried a few times, then given up: the end is reported all the same.
    for _ in range(3):
        env.agent.supervise_once()
    assert env.portal.states("j1")[-1] == "timeout" and env.agent.jobs() == {} and env.driver.sandboxes == {}


def test_a_log_chunk_refused_a_few_times_is_skipped_not_retried_forever(env):
    env.agent.log_chunk_bytes = 4
    env.agent.launch("j1", 1, SPEC)
    env.driver.by_job("j1")["log"] = b"bad!good"
    env.portal.refuse_logs = 3
    for _ in range(4):
        env.agent.supervise_once()
    assert env.portal.log_bytes("j1") == b"good" and env.portal.log_chunks[0][2] == 4


def test_any_error_in_a_report_skips_no_enforcement(env, monkeypatch):
    """Whatever a report raises (a bug, a 500 the client did not expect), each job's time limit
    and the lease are still checked in that pass."""
    env.agent.launch("j1", 1, SPEC)
    env.agent.launch("j2", 1, {**SPEC, "gpu_indexes": [3]})
    for j in ("j1", "j2"):
        env.driver.by_job(j)["log"] = b"x\n"

    def broken(*a, **k):
        raise RuntimeError("surprise")

    monkeypatch.setattr(env.portal, "logs", broken)
    _past_time_limit(env)
    env.agent.supervise_once()
    assert env.driver.running() == []
    assert [s[:2] for s in env.driver.stopped] == [("j1", 1), ("j2", 1)]
    # A driver that cannot even poll does not stop the time limit either.
    env.agent.launch("j3", 1, {**SPEC, "gpu_indexes": [0]})
    monkeypatch.setattr(env.driver, "poll", broken)
    env.agent.supervise_once()
    assert ("j3", 1) in [s[:2] for s in env.driver.stopped]
    # Nor the lease: the portal has been silent for longer than it.
    env.clock.t += env.agent.lease_s + 1
    env.portal.unreachable = True
    env.agent.supervise_once()
    assert env.agent.fenced


def test_a_refused_end_report_is_sent_again_shorter(env):
    env.agent.launch("j1", 1, SPEC)
    env.portal.refuse_events = 1
    env.driver.exit("j1", 3)
    env.agent.supervise_once()
    assert ("j1", 1) in env.agent.jobs()  # kept: the portal must learn the end
    env.agent.supervise_once()
    (end,) = [e for e in env.portal.events if e[2] == "failed"]
    assert end[3] is None and "refused" in end[4] and env.agent.jobs() == {}


def test_a_full_log_stops_shipping(env):
    env.agent.log_chunk_bytes = 4
    env.portal.log_cap = 8
    env.agent.launch("j1", 1, SPEC)
    sbx = env.driver.by_job("j1")
    sbx["log"] = b"0123456789abcdef"
    env.agent.supervise_once()
    sbx["log"] += b"more"
    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    assert env.portal.log_bytes("j1") == b"01234567" and env.portal.states("j1")[-1] == "succeeded"


def test_a_chatty_job_ships_a_bounded_amount_per_pass(env):
    env.agent.log_chunk_bytes = 4
    env.agent.log_pass_bytes = 8
    env.driver.read_limit = 4  # a driver may return part of what is there
    env.agent.launch("j1", 1, SPEC)
    env.driver.by_job("j1")["log"] = b"x" * 20
    env.agent.supervise_once()
    assert len(env.portal.log_bytes("j1")) == 8
    env.driver.exit("j1", 0)
    env.agent.supervise_once()  # at the end, everything
    assert env.portal.log_bytes("j1") == b"x" * 20


def test_xids_survive_a_failed_heartbeat(env):
    env.probe.inject_xid(2, 48)
    env.portal.unreachable = True
    env.agent.heartbeat_once()
    env.portal.unreachable = False
    env.agent.heartbeat_once()
    samples = env.portal.heartbeats[-1]["samples"]
    assert samples[2]["xid_errors"] == [48]


def test_a_failed_stop_is_tried_again(env):
    env.agent.launch("j1", 1, SPEC)
    real_stop, calls = env.driver.stop, []

    def flaky_stop(h, grace_s):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine hiccup")
        real_stop(h, grace_s)

    env.driver.stop = flaky_stop
    env.wall.t = 2000  # past the 600 s limit
    env.agent.supervise_once()
    assert ("j1", 1) in env.agent.jobs() and env.driver.running() == [("j1", 1)]
    env.agent.supervise_once()
    assert env.driver.running() == [] and env.portal.events[-1][2] == "timeout"


# -- GPU memory scrub between tenants (docs/reliability.md 2.2, G-03) ----------------


def test_gpus_are_scrubbed_before_the_terminal_report(env, monkeypatch):
    order = []
    scrub = env.probe.scrub
    monkeypatch.setattr(env.probe, "scrub", lambda idx: order.append(("scrub", list(idx))) or scrub(idx))
    event = env.portal.event
    monkeypatch.setattr(env.portal, "event", lambda *a, **kw: order.append(("event", a[2])) or event(*a, **kw))
    env.agent.launch("j1", 1, SPEC)
    assert env.probe.residue(1) and env.probe.residue(2) and not env.probe.residue(0)
    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    assert order[-2:] == [("scrub", [1, 2]), ("event", "succeeded")]
    assert not env.probe.residue(1) and not env.probe.residue(2)
    assert env.portal.scrub_failures == []


def test_a_gpu_that_cannot_be_scrubbed_is_named_in_the_report(env):
    env.agent.launch("j1", 1, SPEC)
    env.probe.inject_scrub_failure(2, "cuMemAlloc_v2 failed: CUDA_ERROR_ECC_UNCORRECTABLE")
    env.driver.exit("j1", 3)
    env.agent.supervise_once()
    assert env.portal.states("j1")[-1] == "failed"  # the job's own outcome is unchanged
    assert env.portal.scrub_failures == [("j1", 1, [
        {"gpu_index": 2, "message": "cuMemAlloc_v2 failed: CUDA_ERROR_ECC_UNCORRECTABLE"}])]
    assert env.probe.residue(2) and not env.probe.residue(1)


def test_a_retried_report_does_not_scrub_again(env, monkeypatch):
    calls = []
    scrub = env.probe.scrub
    monkeypatch.setattr(env.probe, "scrub", lambda idx: calls.append(list(idx)) or scrub(idx))
    env.agent.launch("j1", 1, SPEC)
    env.driver.exit("j1", 0)
    env.portal.unreachable = True
    env.agent.supervise_once()
    env.agent.supervise_once()
    env.portal.unreachable = False
    env.agent.supervise_once()
    # Once before the job (every GPU is dirty when the agent starts), once after it.
    assert calls == [[1, 2], [1, 2]] and env.portal.states("j1")[-1] == "succeeded"


def test_a_shared_gpu_is_scrubbed_by_the_last_job_to_leave(env, monkeypatch):
    calls = []
    scrub = env.probe.scrub
    monkeypatch.setattr(env.probe, "scrub", lambda idx: calls.append(list(idx)) or scrub(idx))
    env.agent.launch("a", 1, {**SPEC, "gpu_indexes": [3], "gpu_fraction": 0.5})
    env.agent.launch("b", 1, {**SPEC, "gpu_indexes": [3], "gpu_fraction": 0.5})
    assert calls == [[3]]  # before a; b joins a GPU a computes on: nothing to scrub then
    env.driver.exit("a", 0)
    env.agent.supervise_once()
    assert calls == [[3]] and env.portal.states("a")[-1] == "succeeded"  # b still computes on GPU 3
    env.driver.exit("b", 0)
    env.agent.supervise_once()
    assert calls == [[3], [3]] and not env.probe.residue(3)


def test_a_crashing_scrub_still_reports_the_job(env, monkeypatch):
    def boom(idx):
        raise RuntimeError("driver went away")

    env.agent.launch("j1", 1, SPEC)
    monkeypatch.setattr(env.probe, "scrub", boom)
    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    assert env.portal.states("j1")[-1] == "succeeded"
    (_, _, failures), = env.portal.scrub_failures
    assert [f["gpu_index"] for f in failures] == [1, 2] and "driver went away" in failures[0]["message"]


def test_scrub_can_be_turned_off(env, monkeypatch):
    monkeypatch.setattr(env.agent, "scrub_gpus", False)
    env.agent.launch("j1", 1, SPEC)
    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    assert env.probe.residue(1) and env.portal.states("j1")[-1] == "succeeded"


def test_a_whole_gpu_is_not_shared_with_a_sandbox_that_still_holds_it(env):
    # The portal freed GPU 2 (a cancel whose stop has not arrived yet) and placed j2 on it.
    env.agent.launch("j1", 1, SPEC)
    env.agent.gpu_release_wait_s = 0.0
    assert env.agent.launch("j2", 1, {**SPEC, "gpu_indexes": [2, 3]}) == "failed"
    assert "GPU(s) [2] still held by another job's sandbox" in env.portal.events[-1][4]
    assert [s.job_id for s in env.driver.launched] == ["j1"]


def test_a_launch_waits_for_the_old_sandbox_then_scrubs_and_starts(env, monkeypatch):
    import time

    calls = []
    scrub = env.probe.scrub
    monkeypatch.setattr(env.probe, "scrub", lambda idx: calls.append(list(idx)) or scrub(idx))
    env.agent.launch("j1", 1, SPEC)
    result = []
    th = threading.Thread(target=lambda: result.append(env.agent.launch("j2", 1, {**SPEC, "gpu_indexes": [2, 3]})))
    th.start()
    deadline = time.monotonic() + 10
    while "starting" not in env.portal.states("j2"):  # confirmed, now waiting for GPU 2
        assert time.monotonic() < deadline, "j2 never got to its GPU wait"
        time.sleep(0.01)
    assert [s.job_id for s in env.driver.launched] == ["j1"]
    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    th.join(10)
    assert result == ["started"]
    # j1's GPUs were scrubbed at its end, so j2 scrubs only GPU 3 (dirty since the agent started).
    assert calls == [[1, 2], [1, 2], [3]]


def test_a_gpu_that_cannot_be_scrubbed_before_a_job_fails_the_launch_and_says_so(env):
    env.probe.inject_scrub_failure(3, "still used by process(es) 99 after the job ended")
    assert env.agent.launch("j1", 1, {**SPEC, "gpu_indexes": [3]}) == "failed"
    assert env.driver.launched == []
    assert "GPU(s) [3] could not be scrubbed before the job" in env.portal.events[-1][4]
    assert env.portal.scrub_failures == [("j1", 1, [
        {"gpu_index": 3, "message": "still used by process(es) 99 after the job ended"}])]


def test_a_sandbox_that_cannot_be_killed_is_reported_and_its_gpus_withheld(env):
    """docs/reliability.md F-15: the backend refuses the kill; the job still ends once, and the report
    tells the portal to drain the node and take the GPUs out of service."""
    env.agent.launch("j1", 1, SPEC)
    env.driver.unkillable.add("j1")
    env.agent.kill_wait_s = 0.0
    scrubbed = []
    env.probe.scrub = lambda idx: scrubbed.append(idx) or {}
    env.agent.stop("j1", 1, "cancelled by alice", grace_s=0)
    assert scrubbed == []  # its processes may still run there: nothing is scrubbed, nothing handed on
    (_, _, state, code, msg), = [e for e in env.portal.events if e[2] == "cancelled"]
    assert "could not be killed" in msg
    assert env.portal.node_problems == [("j1", 1, "the sandbox of job j1 attempt 1 could not be killed")]
    assert env.portal.scrub_failures == [("j1", 1, [
        {"gpu_index": 1, "message": "held by a sandbox that could not be killed"},
        {"gpu_index": 2, "message": "held by a sandbox that could not be killed"}])]


def test_a_job_for_another_sandbox_is_refused(env, monkeypatch):
    monkeypatch.setattr(env.driver, "name", "docker")
    assert env.agent.launch("j1", 1, {**SPEC, "sandbox": "kvm"}) == "failed"
    assert "asks for the kvm sandbox; node n1 runs docker sandboxes" in env.portal.events[-1][4]
    assert env.driver.launched == []


def test_a_shared_gpu_is_not_scrubbed_under_a_job_that_is_still_starting(env, monkeypatch):
    """Job c is placed on GPU 3 next to a; while c's sandbox is being created, a ends: a's scrub
    would grab c's memory (or see c's process and drain the node), so it leaves GPU 3 to c."""
    calls = []
    scrub = env.probe.scrub
    monkeypatch.setattr(env.probe, "scrub", lambda idx: calls.append(list(idx)) or scrub(idx))
    shared = {**SPEC, "gpu_indexes": [3], "gpu_fraction": 0.5}
    env.agent.launch("a", 1, shared)
    in_launch, release = threading.Event(), threading.Event()
    launch = env.driver.launch

    def slow_launch(spec):
        in_launch.set()
        assert release.wait(10)
        return launch(spec)

    monkeypatch.setattr(env.driver, "launch", slow_launch)
    th = threading.Thread(target=env.agent.launch, args=("c", 1, shared))
    th.start()
    assert in_launch.wait(10)
    env.driver.exit("a", 0)
    env.agent.supervise_once()
    assert env.portal.states("a")[-1] == "succeeded" and calls == [[3]]  # only a's own launch scrubbed
    release.set()
    th.join(10)
    assert "running" in env.portal.states("c")
    env.driver.exit("c", 0)
    env.agent.supervise_once()
    assert calls == [[3], [3]]  # the last one out
