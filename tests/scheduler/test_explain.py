"""Explaining a pass never changes it, and reasons are true (production runs with explain on,
the simulator with it off: both must plan the same)."""
from __future__ import annotations

import copy
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from scheduler.core import schedule

from .factories import NOW, job, nodes, running, snapshot, started
from .test_properties import SETTINGS, snapshots

H = 3600.0


def decisions(plan):
    return (plan.starts, plan.preemptions, plan.reservations, plan.fragmented)


def both_modes(snap):
    """The plan with explain on and off, each on its own copy of the snapshot."""
    on = copy.deepcopy(snap)
    on.config = replace(on.config, explain=True)
    off = copy.deepcopy(snap)
    off.config = replace(off.config, explain=False)
    return schedule(on), schedule(off)


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)), st.sampled_from([200, 0, 1, 2, 3]),
       st.sampled_from(["fifo", "fifo-backfill", "multifactor", "las"]), st.booleans())
def test_explain_never_changes_the_plan(snap, depth, policy, quotas):
    snap.config = replace(snap.config, max_failed_placements=depth, policy=policy, quotas=quotas)
    on, off = both_modes(snap)
    assert decisions(on) == decisions(off)
    assert off.waiting == {}


def full_cluster_with_a_reservation(n_big: int):
    """n0 busy for 1 h, n1 busy for 2 h but one GPU: the 8-GPU head gets n0 in 1 h; then
    `n_big` 4-GPU jobs that cannot start in this pass; then a 1-GPU job that fits now."""
    cluster = nodes(2)
    busy = [running(job("r0", 8, project="x", time_limit=2 * H), [f"n0-{i}" for i in range(8)], start=NOW - H),
            running(job("r1", 7, project="x", time_limit=3 * H), [f"n1-{i}" for i in range(7)], start=NOW - H)]
    q = [job("head", 8, submit=NOW - 10_000)]
    q += [job(f"big{i}", 4, submit=NOW - 9000 + i) for i in range(n_big)]
    q.append(job("short", 1, submit=NOW - 10, time_limit=600))
    return snapshot(cluster, q, busy, policy="multifactor", weight_size=0.0, weight_fairshare=0.0)


def test_jobs_that_cannot_start_do_not_use_up_the_search_depth_in_either_mode():
    """200 jobs that cannot fit anyway used to count as failed placements only when explaining,
    so production (explain on) stopped before the 1-GPU job the simulator (explain off) started."""
    snap = full_cluster_with_a_reservation(250)
    on, off = both_modes(snap)
    assert started(on) == started(off) == {"short": ["n1-7"]}
    assert [r.job_id for r in on.reservations] == ["head"]
    assert on.waiting["big0"].code == "resources"
    assert on.waiting["big0"].message == "Waiting for 4 GPUs: 1 whole GPU(s) free now and 0 reserved for higher-priority jobs"


def test_past_the_search_depth_a_job_is_told_it_was_not_examined_not_given_a_hint():
    snap = full_cluster_with_a_reservation(3)
    snap.config.max_failed_placements = 1
    on, off = both_modes(snap)
    assert decisions(on) == decisions(off)
    assert on.starts == []  # the head used the one failed placement allowed
    msg = on.waiting["short"].message
    assert on.waiting["short"].code == "priority" and "not examined" in msg and "time limit" not in msg


def test_no_time_limit_hint_when_the_reserved_gpus_would_not_make_the_job_fit():
    """Two GPUs held for the head on n1 and two free on n2 add up to four, but not on one node:
    a shorter limit would not let the 4-GPU job start, so its reason must not say it would."""
    cluster = nodes(3, per=4)
    busy = [running(job("r0", 4, project="x", time_limit=10 * H), [f"n0-{i}" for i in range(4)]),
            running(job("r1", 2, project="x", time_limit=1.44 * H), ["n1-0", "n1-1"], start=NOW),
            running(job("r2", 2, project="x", time_limit=10 * H), ["n2-0", "n2-1"])]
    q = [job("head", 4, submit=NOW - 500), job("s600", 4, submit=NOW - 400, time_limit=600)]
    plan = schedule(snapshot(cluster, q, busy, policy="multifactor", weight_size=0.0, weight_fairshare=0.0))
    assert [(r.job_id, r.start_time) for r in plan.reservations] == [("head", NOW + 1.44 * H)]
    assert plan.starts == []
    reason = plan.waiting["s600"]
    assert "time limit" not in reason.message, reason
    assert reason.code == "resources"


def test_the_hint_names_a_limit_below_the_jobs_own_and_is_true():
    """A 4-GPU job of 4 h fits on the head's held GPUs; under 1 h it would start now, and does."""
    cluster = nodes(2)
    busy = [running(job("r0", 8, project="x", time_limit=3 * H), [f"n0-{i}" for i in range(8)], start=NOW - H),
            running(job("r1", 4, project="x", time_limit=2 * H), [f"n1-{i}" for i in range(4)], start=NOW - H)]
    cfg = dict(policy="multifactor", weight_size=0.0, weight_fairshare=0.0)
    q = [job("head", 8, submit=NOW - 500), job("long", 4, submit=NOW - 300, time_limit=4 * H)]
    plan = schedule(snapshot(cluster, q, busy, **cfg))
    assert plan.starts == [] and plan.waiting["long"].code == "reservation"
    assert plan.waiting["long"].message.endswith("a time limit under 1 h would let it start now")
    q[1].time_limit = H - 1
    assert list(started(schedule(snapshot(cluster, q, busy, **cfg)))) == ["long"]
