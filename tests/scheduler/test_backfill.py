"""EASY backfill: the head job's reservation, and who may jump ahead of it."""
from scheduler.core import schedule

from .factories import NOW, job, nodes, running, snapshot, started

H = 3600.0
# Submit order with EASY backfill: multifactor by age alone (fifo is strict, fifo-backfill first fit).
EASY_FIFO = dict(policy="multifactor", weight_size=0.0, weight_fairshare=0.0)


def cluster_with_head_blocked():
    """n0 busy for 2 h; n1 half busy for 1 h: an 8-GPU head job can start in 1 h on n1."""
    cluster = nodes(2)
    busy = [running(job("r0", 8, time_limit=3 * H), [f"n0-{i}" for i in range(8)], start=NOW - H),
            running(job("r1", 4, time_limit=2 * H), [f"n1-{i}" for i in range(4)], start=NOW - H)]
    return cluster, busy


def test_head_job_gets_a_reservation_at_its_earliest_start():
    cluster, busy = cluster_with_head_blocked()
    plan = schedule(snapshot(cluster, [job("head", 8, submit=NOW - 500)], busy, **EASY_FIFO))
    (res,) = plan.reservations
    assert res.job_id == "head" and res.start_time == NOW + H
    assert sorted(res.gpu_ids) == sorted(f"n1-{i}" for i in range(8))


def test_a_short_job_backfills_and_a_long_one_waits():
    cluster, busy = cluster_with_head_blocked()
    q = [job("head", 8, submit=NOW - 500), job("short", 2, submit=NOW - 400, time_limit=H / 2),
         job("long", 2, submit=NOW - 300, time_limit=4 * H)]
    plan = schedule(snapshot(cluster, q, busy, **EASY_FIFO))
    assert list(started(plan)) == ["short"]
    assert plan.waiting["long"].code == "reservation"
    assert "time limit under 1 h" in plan.waiting["long"].message
    assert plan.waiting["head"].position == 1 and plan.waiting["long"].position == 2


def test_a_long_job_may_use_gpus_the_reservation_does_not_need():
    cluster, busy = cluster_with_head_blocked()
    cluster += nodes(1, prefix="m")
    busy.append(running(job("r2", 6, time_limit=5 * H), [f"m0-{i}" for i in range(6)], start=NOW - H))
    q = [job("head", 8, submit=NOW - 500), job("long", 2, submit=NOW - 300, time_limit=10 * H)]
    plan = schedule(snapshot(cluster, q, busy, **EASY_FIFO))
    assert started(plan) == {"long": ["m0-6", "m0-7"]}


def test_without_backfill_the_head_blocks_everyone():
    cluster, busy = cluster_with_head_blocked()
    q = [job("head", 8, submit=NOW - 500), job("short", 1, submit=NOW - 400, time_limit=60)]
    plan = schedule(snapshot(cluster, q, busy, policy="fifo-backfill", backfill=False))
    assert plan.starts == [] and plan.reservations == []
    assert plan.waiting["short"].code == "priority"


def test_a_fragmented_head_job_gets_a_node_reserved_and_says_so():
    """Three GPUs free on three nodes, none with two: the 2-GPU head job waits fragmented with
    a reservation on the node that frees first, and a long job may not take that node's GPU."""
    cluster = nodes(3, per=2)
    busy = [running(job("r0", 1, time_limit=3 * H), ["n0-0"], start=NOW - H),
            running(job("r1", 1, time_limit=2 * H), ["n1-0"], start=NOW - H),
            running(job("r2", 1, time_limit=4 * H), ["n2-0"], start=NOW - H)]
    q = [job("head", 2, submit=NOW - 500), job("long", 1, submit=NOW - 300, time_limit=10 * H)]
    plan = schedule(snapshot(cluster, q, busy, **EASY_FIFO))
    (res,) = plan.reservations
    assert res.job_id == "head" and res.start_time == NOW + H and sorted(res.gpu_ids) == ["n1-0", "n1-1"]
    assert plan.waiting["head"].code == "fragmented"
    assert plan.waiting["head"].message == ("fragmented: 3 GPUs free but no node has 2; next to start, "
                                            "GPUs on n1 reserved for it in 1 h at the latest")
    assert started(plan)["long"][0] in {"n0-1", "n2-1"}
