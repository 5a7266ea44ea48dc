"""`las`: Tiresias' discretized two-dimensional least attained service."""
from scheduler.core import schedule

from .factories import NOW, job, nodes, quota, running, snapshot, started

H = 3600.0
LAS = dict(policy="las", las_thresholds_gpu_s=(H,), las_starvation_factor=4.0)


def one_free_gpu(queued, run=None, **kw):
    cluster = nodes(1, per=2)
    run = run or [running(job("r0", 1, project="x", time_limit=10 * H), ["n0-0"], start=NOW - 60)]
    return schedule(snapshot(cluster, queued, run, **{**LAS, **kw}))


def test_fifo_within_a_queue_and_the_lower_queue_first():
    # both below the 1 GPU-hour threshold: submit order
    plan = one_free_gpu([job("a", 1, submit=NOW - 50, attained_gpu_s=0.5 * H), job("b", 1, submit=NOW - 10)])
    assert list(started(plan)) == ["a"]
    # a has passed the threshold (2 GPUs x 40 min): b, in the first queue, goes first
    plan = one_free_gpu([job("a", 1, submit=NOW - 50, attained_gpu_s=80 * 60 * 2, queued_since=NOW - 60),
                         job("b", 1, submit=NOW - 10)])
    assert list(started(plan)) == ["b"]
    assert plan.waiting["a"].position == 1


def test_a_job_waiting_longer_than_k_times_its_service_is_promoted():
    # a ran 1 h on 1 GPU (queue 1) and has waited 5 h > 4 x 1 h since: back in the first queue,
    # where it is the oldest
    a = job("a", 1, submit=NOW - 10 * H, attained_gpu_s=H, queued_since=NOW - 5 * H)
    plan = one_free_gpu([a, job("b", 1, submit=NOW - 10)])
    assert list(started(plan)) == ["a"]
    a.queued_since = NOW - 3 * H  # 3 h < 4 x 1 h: still in queue 1
    assert list(started(one_free_gpu([a, job("b", 1, submit=NOW - 10)]))) == ["b"]


def test_a_new_job_preempts_running_work_with_more_attained_service():
    """r-long has had 8 GPUs x 2 h (queue 1); the new 8-GPU job is in queue 0 and preempts it.
    r-young (same size, 5 min on the other node) is under the threshold and is left alone."""
    cluster = nodes(2)
    run = [running(job("r-long", 8, project="x", time_limit=48 * H), [f"n0-{i}" for i in range(8)], start=NOW - 2 * H),
           running(job("r-young", 8, project="x", time_limit=48 * H), [f"n1-{i}" for i in range(8)],
                   start=NOW - 300, )]
    plan = schedule(snapshot(cluster, [job("new", 8, project="bob")], run, **LAS, min_runtime_s=60))
    assert [p.job_id for p in plan.preemptions] == ["r-long"]
    assert "least attained service" in plan.preemptions[0].reason
    assert plan.waiting["new"].code == "preempting" and plan.starts == []


def test_attained_service_counts_earlier_attempts_and_the_minimum_runtime_holds():
    cluster = nodes(1)
    # 10 minutes into this attempt, but 2 GPU-hours from earlier ones: queue 1
    run = [running(job("r", 8, project="x", time_limit=48 * H, attained_gpu_s=2 * H), [f"n0-{i}" for i in range(8)],
                   start=NOW - 600)]
    plan = schedule(snapshot(cluster, [job("new", 8, project="bob")], run, **LAS, min_runtime_s=300))
    assert [p.job_id for p in plan.preemptions] == ["r"]
    plan = schedule(snapshot(cluster, [job("new", 8, project="bob")], run, **LAS, min_runtime_s=900))
    assert plan.preemptions == [] and plan.waiting["new"].code != "preempting"


def test_no_preemption_within_the_same_queue_or_with_preemption_off():
    cluster = nodes(1)
    run = [running(job("r", 8, project="x", time_limit=48 * H), [f"n0-{i}" for i in range(8)], start=NOW - 2 * H)]
    plan = schedule(snapshot(cluster, [job("new", 8, project="bob", attained_gpu_s=2 * H, queued_since=NOW)], run,
                             **LAS))
    assert plan.preemptions == []
    plan = schedule(snapshot(cluster, [job("new", 8, project="bob")], run, **LAS, preemption=False))
    assert plan.preemptions == []


def test_a_job_whose_attempt_has_run_past_the_loss_bound_is_not_preempted():
    """8 GPUs x 5 h = 40 GPU-hours would be lost (jobs restart from zero): above the default
    bound of 32 the las rule leaves it running; without a bound it is preempted."""
    cluster = nodes(1)
    run = [running(job("r", 8, project="x", time_limit=48 * H), [f"n0-{i}" for i in range(8)], start=NOW - 5 * H)]
    plan = schedule(snapshot(cluster, [job("new", 8, project="bob")], run, **LAS))
    assert plan.preemptions == []
    plan = schedule(snapshot(cluster, [job("new", 8, project="bob")], run, **LAS, las_max_loss_gpu_s=None))
    assert [p.job_id for p in plan.preemptions] == ["r"]


def _saver(ran, interval=1800.0):
    """An 8-GPU job of queue 1 that saves on its own every `interval` s and has run `ran` s."""
    return running(job("r", 8, project="x", time_limit=48 * H, checkpoint_grace_s=120,
                       checkpoint_interval_s=interval), [f"n0-{i}" for i in range(8)], start=NOW - ran)


def test_a_job_that_saves_on_its_own_is_preempted_only_just_after_a_save():
    # 2 h 15 min run, saves every 30 min: 15 min since its last save, all of which it would lose.
    # The new job waits, and the plan names the instant of r's next save for the next pass.
    plan = schedule(snapshot(nodes(1), [job("new", 8, project="bob")], [_saver(2 * H + 900)], **LAS))
    assert plan.preemptions == [] and plan.waiting["new"].code != "preempting"
    assert plan.next_pass_at == NOW + 900
    # 60 s after a save (within las_checkpoint_window_s, 120 s): it is preempted and loses 60 s + grace
    plan = schedule(snapshot(nodes(1), [job("new", 8, project="bob")], [_saver(2 * H + 60)], **LAS))
    assert [p.job_id for p in plan.preemptions] == ["r"] and plan.next_pass_at is None
    # a wider window takes it 15 min after its save; a job that saves when signalled any time
    plan = schedule(snapshot(nodes(1), [job("new", 8, project="bob")], [_saver(2 * H + 900)], **LAS,
                             las_checkpoint_window_s=1800))
    assert [p.job_id for p in plan.preemptions] == ["r"]
    plan = schedule(snapshot(nodes(1), [job("new", 8, project="bob")], [_saver(2 * H + 900, None)], **LAS))
    assert [p.job_id for p in plan.preemptions] == ["r"]


def test_before_its_first_save_a_job_that_saves_on_its_own_is_not_a_las_victim():
    # 20 min into an attempt that resumed from 2 GPU-hours: queue 1, past the minimum runtime, but
    # nothing saved yet in this attempt
    r = _saver(1200)
    r.job.attained_gpu_s = 2 * H
    plan = schedule(snapshot(nodes(1), [job("new", 8, project="bob")], [r], **LAS))
    assert plan.preemptions == [] and plan.next_pass_at == NOW + 600


def test_with_fair_share_within_a_queue_the_project_furthest_below_its_share_goes_first():
    # Both in the first queue, one GPU free; x has used 10 GPU-hours, bob nothing. FIFO takes x's
    # older job; with fair share bob's goes first. A lower queue still goes before fair share.
    def plan(fair, bob_attained=0.0):
        queued = [job("a", 1, project="x", submit=NOW - 50),
                  job("b", 1, project="bob", submit=NOW - 10, attained_gpu_s=bob_attained, queued_since=NOW - 60)]
        projects = {"x": quota("x", 1, 2), "bob": quota("bob", 1, 2)}
        return schedule(snapshot(nodes(1, per=1), queued, projects=projects, usage={"x": 10 * H}, **LAS,
                                 las_fair_share=fair))
    assert list(started(plan(False))) == ["a"]
    assert list(started(plan(True))) == ["b"]
    assert list(started(plan(True, bob_attained=2 * H))) == ["a"]
