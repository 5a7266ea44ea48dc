"""Dataset locality in the core: nodes holding a job's datasets are preferred (the bonus), a job
may wait a capped time for a busy one (the reason says so), a reservation asks its node to
prefetch, and nothing changes for jobs that name no datasets."""
from __future__ import annotations

import copy
import random
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from scheduler.core import Dataset, schedule

from .factories import NOW, job, nodes, running, snapshot, started
from .test_explain import both_modes, decisions
from .test_properties import SETTINGS, snapshots

GB = 10**9
IMAGENET = Dataset("a" * 64, 150 * GB, "imagenet@3")
COCO = Dataset("c" * 64, 20 * GB, "coco@1")


def cluster(n: int = 3, per: int = 8):
    return nodes(n, per=per)


def fill(node: str, k: int, limit: float = 3600, project: str = "x"):
    """A running job holding the first `k` GPUs of `node`."""
    return running(job(f"busy-{node}", k, project=project, time_limit=limit), [f"{node}-{i}" for i in range(k)])


def test_a_node_holding_the_dataset_is_preferred_over_the_best_fit():
    c = cluster()
    c[2].datasets = {IMAGENET.digest}
    run = [fill("n0", 6)]  # best fit alone would take n0 (2 left, the tightest)
    plain = schedule(snapshot(c, [job("j", 2)], run))
    assert started(plain) == {"j": ["n0-6", "n0-7"]}
    plan = schedule(snapshot(c, [job("j", 2, datasets=(IMAGENET,))], run))
    assert started(plan) == {"j": ["n2-0", "n2-1"]}
    assert plan.locality_waits == {} and plan.prefetch == {}


def test_more_of_its_bytes_wins_and_best_fit_decides_among_equals():
    c = cluster(4)
    c[0].datasets = {COCO.digest}
    c[1].datasets = {IMAGENET.digest}
    c[3].datasets = {IMAGENET.digest}
    run = [fill("n3", 4)]  # n1 and n3 hold the same bytes: best fit between them takes n3
    plan = schedule(snapshot(c, [job("j", 2, datasets=(IMAGENET, COCO))], run))
    assert started(plan) == {"j": ["n3-4", "n3-5"]}


def test_a_job_waits_for_a_busy_holder_up_to_the_cap_then_takes_any_node():
    c = cluster()
    c[1].datasets = {IMAGENET.digest}
    run = [fill("n1", 8)]
    j = job("j", 2, submit=NOW - 20, datasets=(IMAGENET,))
    plan = schedule(snapshot(c, [j], run, locality_wait_s=60))
    assert plan.starts == []
    reason = plan.waiting["j"]
    assert reason.code == "locality"
    assert reason.message.startswith("Waiting up to 40 s more for a node that holds imagenet@3 (n1, busy now)")
    assert plan.locality_waits == {"j": NOW + 40}
    # The cap counts from when it entered the queue (a requeued job: its requeue).
    late = schedule(snapshot(c, [replace(j, submit_time=NOW - 61)], run, locality_wait_s=60))
    assert started(late) == {"j": ["n0-0", "n0-1"]} and late.locality_waits == {}
    requeued = schedule(snapshot(c, [replace(j, submit_time=NOW - 5000, queued_since=NOW - 10)], run, locality_wait_s=60))
    assert requeued.waiting["j"].code == "locality" and requeued.locality_waits == {"j": NOW + 50}
    # A wait of 0 is the bonus only: never a wait.
    assert started(schedule(snapshot(c, [j], run, locality_wait_s=0))) == {"j": ["n0-0", "n0-1"]}


def test_no_wait_for_a_holder_too_small_for_the_job_or_holding_only_part_of_its_data():
    c = nodes(2, per=8) + nodes(1, per=4, prefix="small")
    c[2].datasets = {IMAGENET.digest}
    plan = schedule(snapshot(c, [job("j", 8, datasets=(IMAGENET,))], [fill("n0", 8)]))
    assert started(plan) == {"j": [f"n1-{i}" for i in range(8)]}
    c = cluster()
    c[1].datasets = {IMAGENET.digest}  # holds imagenet but not coco: no node holds all of it
    plan = schedule(snapshot(c, [job("j", 2, datasets=(IMAGENET, COCO))], [fill("n1", 8)]))
    assert started(plan) == {"j": ["n0-0", "n0-1"]}


def test_a_waiting_job_blocks_later_jobs_only_under_strict_fifo():
    c = cluster(2)
    c[1].datasets = {IMAGENET.digest}
    run = [fill("n1", 8)]
    q = [job("data", 2, submit=NOW - 20, datasets=(IMAGENET,)), job("later", 2, submit=NOW - 10)]
    mf = schedule(snapshot(c, q, run, policy="multifactor"))
    assert started(mf) == {"later": ["n0-0", "n0-1"]} and mf.waiting["data"].code == "locality"
    fifo = schedule(snapshot(c, q, run, policy="fifo"))
    assert fifo.starts == [] and fifo.waiting["data"].code == "locality"
    assert fifo.waiting["later"].code == "priority" and "job data" in fifo.waiting["later"].message


def test_a_gang_prefers_and_waits_for_holders_on_each_of_its_nodes():
    c = cluster(4)
    c[1].datasets = c[3].datasets = {IMAGENET.digest}
    g = job("g", 16, nodes=2, submit=NOW - 20, datasets=(IMAGENET,))
    assert sorted({x.split("-")[0] for x in started(schedule(snapshot(c, [g])))["g"]}) == ["n1", "n3"]
    plan = schedule(snapshot(c, [g], [fill("n3", 1)]))  # n0 and n2 are free, one holder is busy
    assert plan.starts == [] and plan.waiting["g"].code == "locality"
    assert "(n1, n3, busy now)" in plan.waiting["g"].message


def test_a_reservation_asks_its_node_to_prefetch_what_it_lacks():
    c = cluster(2)
    c[1].datasets = {COCO.digest}
    run = [fill("n0", 8, limit=3600), running(job("r1", 8, project="x", time_limit=7200),
                                              [f"n1-{i}" for i in range(8)])]
    plan = schedule(snapshot(c, [job("j", 8, datasets=(IMAGENET, COCO))], run))
    assert [(r.job_id, r.gpu_ids[0]) for r in plan.reservations] == [("j", "n0-0")]
    assert plan.prefetch == {"n0": [IMAGENET, COCO]}
    c[0].datasets = {IMAGENET.digest, COCO.digest}  # the node holds it all already: nothing to fetch
    assert schedule(snapshot(c, [job("j", 8, datasets=(IMAGENET, COCO))], run)).prefetch == {}


def test_a_fractional_job_prefers_a_shared_gpu_on_a_holder():
    c = nodes(2, per=2, shared=True)
    c[1].datasets = {IMAGENET.digest}
    run = [running(job("half", 0.5, project="x"), ["n0-0"], fractions={"n0-0": 0.5})]
    assert started(schedule(snapshot(c, [job("f", 0.5)], run))) == {"f": ["n0-0"]}
    assert started(schedule(snapshot(c, [job("f", 0.5, datasets=(IMAGENET,))], run))) == {"f": ["n1-0"]}


# -- no change without datasets, and explain still changes nothing ---------------------------

DIGESTS = [f"{i:064x}" for i in range(4)]


def with_caches(snap, seed: int):
    rnd = random.Random(seed)
    for n in snap.nodes:
        n.datasets = {d for d in DIGESTS if rnd.random() < 0.4}
    return snap


def full_decisions(plan):
    return decisions(plan) + (plan.locality_waits, plan.prefetch)


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)), st.integers(0, 10**6))
def test_node_caches_change_nothing_for_jobs_naming_no_datasets(snap, seed):
    cached = with_caches(copy.deepcopy(snap), seed)
    plain, with_data = schedule(snap), schedule(cached)
    assert full_decisions(plain) == full_decisions(with_data)
    assert plain.waiting == with_data.waiting


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)), st.integers(0, 10**6))
def test_datasets_no_node_holds_change_no_decision(snap, seed):
    rnd = random.Random(seed)
    named = copy.deepcopy(snap)
    for j in named.queued:
        j.datasets = tuple(Dataset(d, rnd.randint(0, 10) * GB, f"d{i}") for i, d in enumerate(DIGESTS)
                           if rnd.random() < 0.5)
    plain, with_data = schedule(snap), schedule(named)
    assert decisions(plain) == decisions(with_data) and with_data.locality_waits == {}
    assert plain.waiting == with_data.waiting


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)), st.integers(0, 10**6), st.sampled_from([0.0, 60.0, 1e9]))
def test_with_datasets_explain_never_changes_the_plan_and_waits_are_capped(snap, seed, wait_s):
    rnd = random.Random(seed)
    with_caches(snap, seed)
    for j in snap.queued:
        j.datasets = tuple(Dataset(d, rnd.randint(1, 10) * GB, f"d{i}") for i, d in enumerate(DIGESTS)
                           if rnd.random() < 0.5)
    snap.config = replace(snap.config, locality_wait_s=wait_s)
    on, off = both_modes(snap)
    assert full_decisions(on) == full_decisions(off)
    jobs = {j.id: j for j in snap.queued}
    for jid, until in on.locality_waits.items():
        j = jobs[jid]
        assert on.waiting[jid].code == "locality"
        assert snap.now < until == (j.queued_since if j.queued_since is not None else j.submit_time) + wait_s
    assert {j for j, r in on.waiting.items() if r.code == "locality"} == set(on.locality_waits)
