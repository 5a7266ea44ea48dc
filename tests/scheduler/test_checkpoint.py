"""Checkpointing jobs in the core and the simulator: they are preempted first (a job that does not
checkpoint only as a last resort), and a preempted one resumes from its last checkpoint."""
import pytest

from scheduler.core import Config, schedule
from scheduler.sim.engine import Simulator, make_projects, saved_on_preemption
from scheduler.sim.metrics import summarize
from scheduler.sim.trace import TraceJob, read_trace, uniform_nodes

from .factories import NOW, job, nodes, quota, running, snapshot

PROJECTS = {"alice": quota("alice", 8, 16), "carol": quota("carol", 0, 16)}


def _carol(name, gpus, gpu_ids, start, **kw):
    return running(job(name, gpus, project="carol", **kw), gpu_ids, start=start, borrowed=True)


def test_a_checkpointing_victim_goes_before_one_that_would_lose_less_work():
    # Two borrowed 8-GPU jobs; the one that checkpoints ran far longer, but it loses only its grace.
    busy = [_carol("plain", 8, [f"n0-{i}" for i in range(8)], NOW - 1200),
            _carol("saver", 8, [f"n1-{i}" for i in range(8)], NOW - 36000, checkpoint_grace_s=120)]
    plan = schedule(snapshot(nodes(2), [job("a", 8)], busy, projects=PROJECTS))
    assert [p.job_id for p in plan.preemptions] == ["saver"]


def test_a_job_that_does_not_checkpoint_is_taken_only_when_nothing_else_makes_room():
    # The checkpointing jobs hold 4 GPUs of each node: no node can be cleared with them alone.
    busy = [_carol("plain", 4, [f"n0-{i}" for i in range(4)], NOW - 1200),
            _carol("s0", 4, [f"n0-{i}" for i in range(4, 8)], NOW - 1200, checkpoint_grace_s=60),
            _carol("s1", 4, [f"n1-{i}" for i in range(4)], NOW - 1200, checkpoint_grace_s=60),
            _carol("bob", 4, [f"n1-{i}" for i in range(4, 8)], NOW - 1200)]
    plan = schedule(snapshot(nodes(2), [job("a", 4)], busy, projects=PROJECTS))
    assert [p.job_id for p in plan.preemptions] in (["s0"], ["s1"])  # one checkpointing job suffices
    plan = schedule(snapshot(nodes(2), [job("a", 8)], busy, projects=PROJECTS))
    victims = sorted(p.job_id for p in plan.preemptions)
    assert len(victims) == 2 and sum(v.startswith("s") for v in victims) == 1  # last resort: one plain job


def test_the_minimum_runtime_holds_for_checkpointing_jobs_too():
    busy = [_carol("saver", 8, [f"n0-{i}" for i in range(8)], NOW - 60, checkpoint_grace_s=120)]
    plan = schedule(snapshot(nodes(1), [job("a", 8)], busy, projects=PROJECTS))
    assert plan.preemptions == []


def test_las_preempts_a_long_checkpointing_job_past_the_loss_bound():
    # 8 GPUs x 10 h is far past las_max_loss_gpu_s (32 GPU-hours): a job that restarts from zero is
    # kept, one that checkpoints loses only its grace and yields to the job with less service.
    for grace, expect in ((None, []), (120.0, ["long"])):
        busy = [running(job("long", 8, project="bob", checkpoint_grace_s=grace), [f"n0-{i}" for i in range(8)],
                        start=NOW - 36000)]
        plan = schedule(snapshot(nodes(1), [job("new", 8)], busy, policy="las"))
        assert [p.job_id for p in plan.preemptions] == expect


@pytest.mark.parametrize("ran,interval,kept", [(1500, 600, 1200), (599, 600, 0), (1800, 600, 1800), (77, 0, 77)])
def test_the_work_a_preempted_attempt_keeps(ran, interval, kept):
    assert saved_on_preemption(ran, interval) == kept


def _borrow_then_reclaim(**checkpoints):
    """One GPU. Tenant a (no guarantee) borrows it at 0 for 3600 s; b (guaranteed the GPU) submits
    a 600 s job at 1500, which preempts a (past the 600 s minimum runtime)."""
    jobs = [TraceJob("a1", 0, 3600, 1, "a", 86400), TraceJob("b1", 1500, 600, 1, "b", 86400)]
    projects = make_projects(["a", "b"], 1, {"a": 0, "b": 1}, gpus_per_quota_node=1)
    return Simulator(jobs, uniform_nodes(1, 1), projects, Config(), **checkpoints).run()


def test_without_checkpoints_a_preempted_job_restarts_from_zero():
    res = _borrow_then_reclaim()
    assert {k: r.end for k, r in res.records.items()} == {"a1": 2100 + 3600, "b1": 2100}
    assert res.lost_gpu_s == 1500 and res.records["a1"].preempted == 1


def test_a_checkpointing_job_resumes_from_its_last_checkpoint_and_loses_the_rest_and_its_grace():
    res = _borrow_then_reclaim(checkpoint_interval_s=600, checkpoint_grace_s=60)
    # Saved at 600 and 1200; at 1500 it loses 300 s since then plus the 60 s grace, and resumes at
    # 2100 with 3600 - 1200 = 2400 s left.
    assert {k: r.end for k, r in res.records.items()} == {"a1": 2100 + 2400, "b1": 2100}
    assert res.lost_gpu_s == 360 and res.records["a1"].progress_s == 1200
    out = summarize(res)
    assert out["lost_gpu_hours"] == pytest.approx(360 / 3600)
    assert out["lost_capacity"] == pytest.approx(360 / (1 * 1500))  # capacity x submission window


def test_a_job_that_saves_when_signalled_loses_only_its_grace():
    res = _borrow_then_reclaim(checkpoint_interval_s=0, checkpoint_grace_s=60)
    assert res.records["a1"].end == 2100 + 2100 and res.lost_gpu_s == 60


def test_of_two_checkpointing_victims_the_one_just_past_a_save_goes():
    # Both save every 30 min and would free the node; "late" is 25 min past its last save, "fresh" 2 min.
    busy = [_carol("late", 8, [f"n0-{i}" for i in range(8)], NOW - 3 * 1800 - 1500, checkpoint_grace_s=120,
                   checkpoint_interval_s=1800),
            _carol("fresh", 8, [f"n1-{i}" for i in range(8)], NOW - 1800 - 120, checkpoint_grace_s=120,
                   checkpoint_interval_s=1800)]
    plan = schedule(snapshot(nodes(2), [job("a", 8)], busy, projects=PROJECTS))
    assert [p.job_id for p in plan.preemptions] == ["fresh"]


def _las_saver(**cfg):
    """One GPU under las. a (4 h, saves every 1800 s) runs from 0; at 4000 s it has had 1.1 GPU-hours
    (queue 1) when b (600 s, queue 0) arrives, 400 s after a's save at 3600."""
    jobs = [TraceJob("a", 0, 4 * 3600, 1, "t", 86400), TraceJob("b", 4000, 600, 1, "u", 86400)]
    projects = make_projects(["t", "u"], 1, None)
    return Simulator(jobs, uniform_nodes(1, 1), projects, Config(policy="las", **cfg),
                     checkpoint_interval_s=1800, checkpoint_grace_s=60).run()


def test_the_simulator_preempts_a_saving_job_at_its_next_save():
    # b waits for a's save at 5400 (a pass runs then), preempts it losing only the 60 s grace, runs
    # 5400-6000; a resumes with 14400 - 5400 s left.
    res = _las_saver()
    assert {k: r.end for k, r in res.records.items()} == {"b": 6000, "a": 6000 + 9000}
    assert res.lost_gpu_s == 60 and res.records["a"].preempted == 1
    # Preempting at once (a window of an interval) loses the 400 s since the save too.
    res = _las_saver(las_checkpoint_window_s=1800)
    assert {k: r.end for k, r in res.records.items()} == {"b": 4600, "a": 4600 + 14400 - 3600}
    assert res.lost_gpu_s == 460


def _reclaim_spec_job(grace, interval):
    """As `_borrow_then_reclaim`, but a1's own spec says how it checkpoints (no replay-wide setting)."""
    jobs = [TraceJob("a1", 0, 3600, 1, "a", 86400, checkpoint_grace_s=grace, checkpoint_interval_s=interval),
            TraceJob("b1", 1500, 600, 1, "b", 86400)]
    projects = make_projects(["a", "b"], 1, {"a": 0, "b": 1}, gpus_per_quota_node=1)
    return Simulator(jobs, uniform_nodes(1, 1), projects, Config()).run()


def test_a_job_whose_spec_saves_every_interval_resumes_from_its_last_periodic_save():
    # Its spec saves every 600 s: preempted at 1500 it keeps 1200 s and loses 300 s plus its 60 s grace.
    res = _reclaim_spec_job(60, 600)
    assert res.records["a1"].end == 2100 + 2400 and res.records["a1"].progress_s == 1200
    assert res.lost_gpu_s == 360


def test_a_job_whose_spec_names_no_interval_saves_when_signalled():
    res = _reclaim_spec_job(60, None)
    assert res.records["a1"].end == 2100 + 2100 and res.lost_gpu_s == 60


def test_a_spec_interval_loses_at_most_that_interval_of_work():
    for interval in (100, 450, 1000):
        lost = _reclaim_spec_job(0, interval).lost_gpu_s
        assert 0 <= lost < interval and lost == 1500 % interval


def test_the_trace_columns_give_each_job_its_own_checkpoint(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("job_id,submit_time,duration,gpus,tenant,walltime,checkpoint_grace_s,checkpoint_interval_s\n"
                    "a1,0,3600,1,a,86400,60,600\n"
                    "s1,0,3600,1,a,86400,30,\n"
                    "n1,0,3600,1,a,86400,,\n")
    got = {t.id: (t.checkpoint_grace_s, t.checkpoint_interval_s) for t in read_trace(str(path))}
    assert got == {"a1": (60, 600), "s1": (30, None), "n1": (None, None)}
    # The core sees the first as saving every 600 s, the second as saving when signalled, the third not at all.
    sim = Simulator(read_trace(str(path)), uniform_nodes(3, 1), make_projects(["a"], 3, None), Config())
    ck = {t.id: sim.checkpoint_of(t) for t in sim.jobs}
    assert ck == {"a1": (60, 600), "s1": (30, 0.0), "n1": None}
    # The replay-wide setting covers only the jobs whose spec names none.
    sim = Simulator(read_trace(str(path)), uniform_nodes(3, 1), make_projects(["a"], 3, None), Config(),
                    checkpoint_interval_s=1800, checkpoint_grace_s=120)
    assert {t.id: sim.checkpoint_of(t) for t in sim.jobs}["n1"] == (120, 1800)
