"""Strict FIFO (head of line), FIFO with first-fit backfill, and the quotas switch."""
from scheduler.core import schedule

from .factories import NOW, job, nodes, quota, running, snapshot, started

H = 3600.0


def half_busy():
    """carol's r0 fills n0 (borrowed, started 2 h ago), r1 half of n1: 4 GPUs free, on n1."""
    return nodes(2), [
        running(job("r0", 8, project="carol", time_limit=3 * H), [f"n0-{i}" for i in range(8)], start=NOW - 2 * H,
                borrowed=True),
        running(job("r1", 4, project="carol", time_limit=2 * H), [f"n1-{i}" for i in range(4)])]


def test_strict_fifo_head_blocks_every_later_job_even_with_gpus_free():
    cluster, busy = half_busy()
    q = [job("head", 8, submit=NOW - 300), job("small", 1, project="bob", submit=NOW - 200, time_limit=60)]
    plan = schedule(snapshot(cluster, q, busy, policy="fifo"))
    assert plan.starts == [] and plan.reservations == []
    assert plan.waiting["small"].code == "priority"
    assert "head" in plan.waiting["small"].message and "strict FIFO" in plan.waiting["small"].message


def test_strict_fifo_does_not_let_a_job_within_its_guarantee_pass_an_earlier_borrower():
    """bob's older job would borrow, alice's is within her guarantee: submit order still wins."""
    cluster, busy = half_busy()
    projects = {"alice": quota("alice", 8, 16), "bob": quota("bob", 0, 16), "carol": quota("carol", 12, 12)}
    q = [job("bob1", 4, project="bob", submit=NOW - 300), job("alice1", 4, project="alice", submit=NOW - 200)]
    plan = schedule(snapshot(cluster, q, busy, projects=projects, policy="fifo"))
    assert started(plan) == {"bob1": [f"n1-{i}" for i in range(4, 8)]}
    assert [s.borrowed for s in plan.starts] == [True]
    # multifactor (quotas on) defers the borrower behind the job within its guarantee
    plan = schedule(snapshot(cluster, q, busy, projects=projects, policy="multifactor"))
    assert list(started(plan)) == ["alice1"]


def test_a_job_refused_by_its_own_quota_blocks_nobody():
    """The choice documented in docs/scheduler.md: head of line among jobs that are eligible to
    run now. bob's earliest job is over bob's quota, so alice's later job starts."""
    cluster, busy = half_busy()
    projects = {"alice": quota("alice", 8, 16), "bob": quota("bob", 2, 2), "carol": quota("carol", 12, 12)}
    q = [job("bob-big", 4, project="bob", submit=NOW - 300), job("alice1", 2, submit=NOW - 200)]
    plan = schedule(snapshot(cluster, q, busy, projects=projects, policy="fifo"))
    assert list(started(plan)) == ["alice1"]
    assert plan.waiting["bob-big"].code == "quota_project"


def test_fifo_backfill_is_first_fit_in_submit_order_without_reservations():
    cluster, busy = half_busy()
    q = [job("head", 8, submit=NOW - 500), job("long", 2, project="bob", submit=NOW - 400, time_limit=100 * H),
         job("big", 4, submit=NOW - 300), job("two", 2, project="bob", submit=NOW - 200)]
    plan = schedule(snapshot(cluster, q, busy, policy="fifo-backfill"))
    # long fits first (a reservation would have kept it off n1: it ends long after r1), then
    # big no longer fits and two does.
    assert list(started(plan)) == ["long", "two"]
    assert plan.reservations == []
    assert [plan.waiting[j].position for j in ("head", "big")] == [1, 2]


def test_quotas_off_nothing_is_borrowed_and_no_job_preempts_for_a_guarantee():
    cluster, busy = half_busy()
    projects = {"alice": quota("alice", 16, 16), "bob": quota("bob", 0, 16), "carol": quota("carol", 0, 12)}
    q = [job("bob1", 4, project="bob", submit=NOW - 300), job("alice1", 8, submit=NOW - 100)]
    on = schedule(snapshot(cluster, q, busy, projects=projects, policy="multifactor"))
    assert [(s.job_id, s.borrowed) for s in on.starts] == [("bob1", True)]
    assert [p.job_id for p in on.preemptions] == ["r0"] and on.waiting["alice1"].code == "preempting"
    off = schedule(snapshot(cluster, q, busy, projects=projects, policy="multifactor", quotas=False))
    assert [(s.job_id, s.borrowed) for s in off.starts] == [("bob1", False)]
    assert off.preemptions == [] and off.waiting["alice1"].code == "resources"


def test_strict_fifo_head_within_its_guarantee_preempts_and_still_blocks_later_jobs():
    cluster, busy = half_busy()
    projects = {"alice": quota("alice", 16, 16), "bob": quota("bob", 8, 16), "carol": quota("carol", 0, 12)}
    q = [job("head", 8, submit=NOW - 300), job("small", 1, project="bob", submit=NOW - 200)]
    plan = schedule(snapshot(cluster, q, busy, projects=projects, policy="fifo"))
    assert [p.job_id for p in plan.preemptions] == ["r0"] and plan.starts == []
    assert plan.waiting["head"].code == "preempting" and plan.waiting["small"].code == "priority"
