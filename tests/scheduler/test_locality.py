"""Dataset locality in the core: nodes holding a job's datasets are preferred (the bonus), a job
may wait a capped time for a busy one (the reason says so), a reservation asks its node to
prefetch, and nothing changes for jobs that name no datasets. In the simulator: staging time,
node caches, and the bonus's effect on bytes moved."""
from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from scheduler.core import Config, Dataset, schedule
from scheduler.sim.__main__ import main as sim_main
from scheduler.sim.datasets import DataModel, DataSpec, assign_datasets
from scheduler.sim.engine import Simulator, make_projects
from scheduler.sim.runner import ReplaySpec, replay
from scheduler.sim.trace import TraceJob, uniform_nodes

from .factories import NOW, job, nodes, running, snapshot, started
from .test_explain import both_modes, decisions
from .test_properties import SETTINGS, snapshots
from .test_sim import TRACES

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
    # The GPUs it would take now are held for it until then, so it can still have them.
    assert [(r.job_id, r.start_time, r.gpu_ids) for r in plan.reservations] == [("j", NOW + 40, ["n0-0", "n0-1"])]
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
    assert started(mf) == {"later": ["n0-2", "n0-3"]} and mf.waiting["data"].code == "locality"
    # The GPUs held for it go only to a job that ends before its wait does.
    busy = [job("data", 2, submit=NOW - 20, datasets=(IMAGENET,)), job("later", 6, submit=NOW - 10),
            job("long", 2, submit=NOW - 5), job("short", 2, submit=NOW - 1, time_limit=30)]
    held = schedule(snapshot(c, busy, run, policy="multifactor", weight_size=0.0, weight_fairshare=0.0))
    assert started(held) == {"later": [f"n0-{i}" for i in range(2, 8)], "short": ["n0-0", "n0-1"]}
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


def test_a_reservation_soon_enough_asks_its_node_to_prefetch_what_it_lacks():
    c = cluster(2)
    c[1].datasets = {COCO.digest}
    q = [job("j", 8, datasets=(IMAGENET, COCO))]
    # n0's job must end 5 minutes from now at the latest, n1's in an hour.
    run = [fill("n0", 8, limit=3900), running(job("r1", 8, project="x", time_limit=7200),
                                              [f"n1-{i}" for i in range(8)])]
    plan = schedule(snapshot(c, q, run, prefetch_horizon_s=300))
    assert [(r.job_id, r.start_time, r.gpu_ids[0]) for r in plan.reservations] == [("j", NOW + 300, "n0-0")]
    assert plan.prefetch == {"n0": [IMAGENET, COCO]}
    # Beyond the horizon the reservation may move or the job start elsewhere first: no fetch yet.
    assert schedule(snapshot(c, q, run, prefetch_horizon_s=299)).prefetch == {}
    assert schedule(snapshot(c, q, run)).prefetch == {}  # off by default
    c[0].datasets = {IMAGENET.digest, COCO.digest}  # the node holds it all already: nothing to fetch
    assert schedule(snapshot(c, q, run, prefetch_horizon_s=300)).prefetch == {}


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
    snap.config = replace(snap.config, locality_wait_s=wait_s, prefetch_horizon_s=1e9)
    on, off = both_modes(snap)
    assert full_decisions(on) == full_decisions(off)
    jobs = {j.id: j for j in snap.queued}
    for jid, until in on.locality_waits.items():
        j = jobs[jid]
        assert on.waiting[jid].code == "locality"
        assert snap.now < until == (j.queued_since if j.queued_since is not None else j.submit_time) + wait_s
    assert {j for j, r in on.waiting.items() if r.code == "locality"} == set(on.locality_waits)


# -- the simulator: transfers, caches, and the locality bonus's effect ----------------------

def sim(jobs, n_gpus=16, locality=True, wait=60.0, cache_gb=2000.0, gbps=8.0, per=8):
    nodes = uniform_nodes(n_gpus, per)
    data = DataModel(nodes, DataSpec(count=1, locality=locality, bandwidth_gbps=gbps, cache_gb=cache_gb))
    projects = make_projects(sorted({j.tenant for j in jobs}), n_gpus, None)
    res = Simulator(jobs, nodes, projects, Config(locality_wait_s=wait), data=data).run()
    return res, data


def tj(id, submit, duration, gpus, datasets=(), tenant="t"):
    return TraceJob(id, submit, duration, gpus, tenant, 86400.0, datasets=datasets)


def test_a_job_starting_without_its_data_stages_it_first_and_the_next_one_finds_it_cached():
    d = Dataset("d" * 64, 100 * GB, "big@1")  # 100 GB at 8 Gbit/s: 100 s
    res, data = sim([tj("a", 0, 1000, 8, (d,)), tj("b", 2000, 1000, 8, (d,))])
    assert res.records["a"].end == 1100 and res.records["b"].end == 3000  # a: 100 s of staging, b: none
    assert data.bytes_moved == 100 * GB and data.starts == 2 and data.local_starts == 1


def test_locality_sends_the_next_job_to_the_node_holding_its_data_and_off_does_not():
    d = Dataset("d" * 64, 100 * GB, "big@1")
    # a stages d onto n0000 and ends; c keeps 4 GPUs of n0001 busy, so best fit alone sends b there.
    jobs = [tj("a", 0, 1000, 8, (d,)), tj("c", 0, 50_000, 4), tj("b", 2000, 1000, 4, (d,))]
    on, data_on = sim(jobs)
    off, data_off = sim([TraceJob(**vars(j)) for j in jobs], locality=False)
    assert on.records["b"].end == 3000 and data_on.bytes_moved == 100 * GB
    assert off.records["b"].end == 3100 and data_off.bytes_moved == 200 * GB


def test_a_job_waits_for_the_busy_holder_then_takes_another_node_when_its_wait_ends():
    d = Dataset("d" * 64, 100 * GB, "big@1")
    # a holds n0000 (with d) until 10,100; b wants d at 500 while n0001 is free: it waits 60 s.
    jobs = [tj("a", 0, 10_000, 8, (d,)), tj("b", 500, 1000, 8, (d,))]
    res, data = sim(jobs, wait=60.0)
    assert res.records["b"].first_start == 560 and res.records["b"].end == 560 + 100 + 1000
    res0, _ = sim([TraceJob(**vars(j)) for j in jobs], wait=0.0)
    assert res0.records["b"].first_start == 500


def test_the_cache_evicts_least_recently_used_datasets_but_never_one_in_use():
    data = DataModel(uniform_nodes(8, 8), DataSpec(count=1, cache_gb=250, bandwidth_gbps=8.0))
    a, b, c = (Dataset(x * 64, 100 * GB, x) for x in "abc")

    def alloc(jid):
        return running(job(jid), ["n0000-0"], start=0.0)

    assert data.stage(alloc("ja"), (a,), 0.0) == 100.0
    assert data.stage(alloc("jb"), (b,), 0.0) == 200.0  # queued behind a on the node's link
    data.release("ja")
    assert data.stage(alloc("jc"), (c,), 300.0) == 100.0  # evicts a (unpinned, least recent), keeps b
    assert list(data.caches["n0000"].entries) == [b.digest, c.digest]
    assert data.stage(alloc("ja2"), (a,), 1000.0) == 100.0  # b and c pinned: a is staged, not kept
    assert list(data.caches["n0000"].entries) == [b.digest, c.digest] and data.bytes_moved == 400 * GB


def test_with_locality_off_and_instant_transfers_the_replay_is_the_plain_one():
    base = dict(trace=str(TRACES / "philly_dev.csv"), start_day=48.5, days=0.25, gpus=32, fairness=False)
    plain = replay(ReplaySpec(**base))
    data = replay(ReplaySpec(data=DataSpec(count=20, locality=False, bandwidth_gbps=math.inf), **base))
    assert data["data_starts"] > 100 and data["data_bytes_moved"] > 0
    assert {k: v for k, v in data.items() if not k.startswith(("data_", "wall_s"))} == \
        {k: v for k, v in plain.items() if not k.startswith("wall_s")}


def test_zipf_assignment_is_seeded_and_favours_the_first_datasets():
    jobs = [TraceJob(f"j{i}", i, 10, 1, "t", 100) for i in range(2000)]
    cat = assign_datasets(jobs, DataSpec(count=50, seed=7))
    again = [TraceJob(f"j{i}", i, 10, 1, "t", 100) for i in range(2000)]
    assign_datasets(again, DataSpec(count=50, seed=7))
    assert [j.datasets for j in jobs] == [j.datasets for j in again]
    counts = [sum(j.datasets == (d,) for j in jobs) for d in cat]
    assert counts[0] > counts[9] > counts[49] and sum(counts) == 2000


def test_the_cli_reports_bytes_moved_and_staging(capsys):
    sim_main(["--trace", str(TRACES / "philly_dev.csv"), "--start-day", "48.5", "--days", "0.25", "--gpus", "32",
              "--no-fairness", "--datasets", "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["data_bytes_moved"] > 0 and 0 < out["data_local_starts"] < out["data_starts"]
    assert out["data_staging_mean_s"] > 0


def test_a_job_avoids_the_nodes_that_could_not_start_it_and_says_so():
    """A node reported the job not startable there (its dataset cache full): even holding the job's
    data it is not taken, whole GPUs or a share, and with no other node the job waits saying why."""
    c = cluster(2)
    c[0].datasets = {IMAGENET.digest}
    plain = schedule(snapshot(c, [job("j", 2, datasets=(IMAGENET,))]))
    assert {g.split("-")[0] for g in started(plain)["j"]} == {"n0"}
    avoid = frozenset({"n0"})
    plan = schedule(snapshot(c, [replace(job("j", 2, datasets=(IMAGENET,)), avoid_nodes=avoid)]))
    assert {g.split("-")[0] for g in started(plan)["j"]} == {"n1"}
    shared = nodes(2, shared=True)
    plan = schedule(snapshot(shared, [replace(job("f", 0.5, datasets=(IMAGENET,)), avoid_nodes=avoid)]))
    assert {g.split("-")[0] for g in started(plan)["f"]} == {"n1"}
    alone = snapshot(c[:1], [replace(job("j", 2, datasets=(IMAGENET,)), avoid_nodes=frozenset({"n0"}))])
    on, off = both_modes(alone)
    assert started(on) == started(off) == {}
    assert "not on n0 for now: it could not start there" in on.waiting["j"].message
