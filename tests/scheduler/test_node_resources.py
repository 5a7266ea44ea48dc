"""Every job's CPUs and memory count against its node's, less the system reserve: CPU-only jobs are
placed by them (no longer by count alone), GPU jobs skip nodes without room beside their GPUs, and a
job that fits nowhere waits saying so."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.core import GPU, Allocation, Config, Job, Node, ProjectQuota, Snapshot, schedule
from tests.scheduler.factories import NOW, job, nodes, running, snapshot, started

RESERVE = dict(node_reserved_cpus=1, node_reserved_memory_mb=1024)


def sized(cluster, cpus, memory_mb, sandbox=""):
    for n in cluster:
        n.cpus, n.memory_mb, n.sandbox = cpus, memory_mb, sandbox
    return cluster


def starts(plan) -> dict[str, str | None]:
    """job -> its node: a CPU-only job's own, a GPU job's first GPU's."""
    return {s.job_id: s.node or s.gpu_ids[0].split("-")[0] for s in plan.starts}


def test_cpu_only_jobs_fill_a_node_by_cpus_and_memory_not_by_count():
    cluster = sized(nodes(1, per=0), cpus=5, memory_mb=9216)  # 4 CPUs and 8 GiB for jobs
    queue = [job(f"c{i}", 0, submit=NOW - 100 + i, cpus=2, memory_mb=1024) for i in range(3)]
    plan = schedule(snapshot(cluster, queue, **RESERVE))
    assert starts(plan) == {"c0": "n0", "c1": "n0"}
    assert plan.waiting["c2"].code == "node_resources"
    assert plan.waiting["c2"].message == ("Waiting for 2 CPUs and 1 GiB of memory on one node: no node offering its "
                                          "sandbox has that much free now")
    # Memory binds as well as CPUs, and what runs there counts.
    busy = [running(job("r", 0, cpus=0.5, memory_mb=7000), [], node="n0")]
    plan = schedule(snapshot(cluster, [job("m", 0, cpus=0.5, memory_mb=2048)], busy, **RESERVE))
    assert plan.starts == [] and plan.waiting["m"].code == "node_resources"


def test_cpu_only_jobs_go_to_the_least_busy_node_with_room():
    cluster = sized(nodes(2, per=0), cpus=4, memory_mb=65536)
    busy = [running(job("s1", 0, cpus=0.5), [], node="n0"), running(job("s2", 0, cpus=0.5), [], node="n0"),
            running(job("big", 0, cpus=3), [], node="n1")]
    plan = schedule(snapshot(cluster, [job("small", 0, cpus=1)], busy))
    assert starts(plan) == {"small": "n1"}  # one job there against two
    plan = schedule(snapshot(cluster, [job("two", 0, cpus=2)], busy))
    assert starts(plan) == {"two": "n0"}  # n1 has 1 CPU left


def test_a_job_larger_than_every_node_says_so():
    cluster = sized(nodes(2, per=2), cpus=8, memory_mb=32768)
    plan = schedule(snapshot(cluster, [job("cpu", 0, cpus=64), job("gpu", 1, memory_mb=65536)], **RESERVE))
    assert plan.starts == []
    assert plan.waiting["cpu"].code == plan.waiting["gpu"].code == "node_resources"
    assert "more than any node offering its sandbox has: the largest has 7 CPUs and 31 GiB" in \
        plan.waiting["cpu"].message
    assert "more than any node with such GPUs has" in plan.waiting["gpu"].message


def test_a_gpu_job_skips_a_node_whose_memory_is_taken_and_waits_when_every_one_is():
    cluster = sized(nodes(2, per=2), cpus=16, memory_mb=16384)
    # n0 has the best fit (1 GPU free) but its memory is taken by a CPU-only job.
    busy = [running(job("g", 1), ["n0-0"]), running(job("hog", 0, memory_mb=14000), [], node="n0")]
    plan = schedule(snapshot(cluster, [job("j", 1, memory_mb=4096)], busy, **RESERVE))
    assert started(plan) == {"j": ["n1-0"]}
    busy.append(running(job("hog2", 0, memory_mb=14000), [], node="n1"))
    plan = schedule(snapshot(cluster, [job("j", 1, memory_mb=4096)], busy, **RESERVE))
    assert plan.starts == []
    assert plan.waiting["j"].code == "node_resources"
    assert plan.waiting["j"].message.startswith("Waiting for 4 GiB of memory beside its 1 GPU: the nodes")
    assert plan.reservations == []  # GPUs held for it would not help


def test_fractions_and_gangs_need_room_on_each_of_their_nodes():
    shared = sized(nodes(2, per=1, shared=True), cpus=4, memory_mb=8192)
    busy = [running(job("hog", 0, cpus=4), [], node="n0")]
    plan = schedule(snapshot(shared, [job("f", 0.5, cpus=1)], busy))
    assert started(plan) == {"f": ["n1-0"]}
    gang_nodes = sized(nodes(3, per=2), cpus=4, memory_mb=8192)
    busy = [running(job("hog", 0, cpus=4), [], node="n1")]
    plan = schedule(snapshot(gang_nodes, [job("gang", 4, nodes=2, cpus=2)], busy))
    assert sorted({g.split("-")[0] for g in started(plan)["gang"]}) == ["n0", "n2"]


def test_nodes_of_unknown_size_are_not_accounted():
    """A node added before its agent registered (size 0), or a trace without sizes: as before."""
    plan = schedule(snapshot(nodes(1, per=1), [job("c", 0, cpus=512, memory_mb=10**7), job("g", 1, cpus=512)]))
    assert started(plan) == {"c": [], "g": ["n0-0"]}


# -- the invariant, on random clusters -------------------------------------------------------------

@st.composite
def sized_snapshots(draw) -> Snapshot:
    cluster, run = [], []
    for i in range(draw(st.integers(1, 4))):
        name = f"n{i}"
        gpus = [GPU(f"{name}-{k}", name, k, "A", 16000, shared=draw(st.booleans()))
                for k in range(draw(st.integers(0, 4)))]
        cluster.append(Node(name, "p", gpus, cpus=draw(st.sampled_from([2, 4, 8])),
                            memory_mb=draw(st.sampled_from([4096, 8192, 16384])), sandbox="docker"))
    reserve = (draw(st.sampled_from([0, 0.5, 1])), draw(st.sampled_from([0, 512, 1024])))
    room = {n.name: [n.cpus - reserve[0], n.memory_mb - reserve[1]] for n in cluster}
    for n in cluster:  # what runs now fits (the scheduler put it there)
        for k, g in enumerate(n.gpus):
            c, m = draw(st.sampled_from([0.5, 1, 2])), draw(st.sampled_from([256, 1024, 4096]))
            if draw(st.booleans()) and room[n.name][0] >= c and room[n.name][1] >= m:
                room[n.name][0] -= c
                room[n.name][1] -= m
                j = Job(f"r{n.name}{k}", "alice", "o", "u", 1.0, NOW - 50, 3600, cpus=c, memory_mb=m)
                run.append(Allocation(j, [g.id], NOW - 10))
    queued = []
    for i in range(draw(st.integers(1, 12))):
        gpus = draw(st.sampled_from([0, 0, 0.5, 1, 2]))
        queued.append(Job(f"q{i}", "alice", "o", "u", float(gpus), NOW - 100 + i, 3600,
                          cpus=draw(st.sampled_from([0.25, 1, 2, 3])),
                          memory_mb=draw(st.sampled_from([128, 2048, 6000]))))
    projects = {"alice": ProjectQuota("alice", "o", 1000, 1000)}
    cfg = Config(node_reserved_cpus=reserve[0], node_reserved_memory_mb=reserve[1],
                 policy=draw(st.sampled_from(["fifo", "fifo-backfill", "multifactor"])))
    return Snapshot(NOW, cluster, run, queued, projects, {}, {}, cfg)


@settings(max_examples=int(os.environ.get("SCHED_PROPERTY_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(sized_snapshots())
def test_no_node_is_ever_given_more_cpus_or_memory_than_it_has(snap):
    plan = schedule(snap)
    node_of = {g.id: n.name for n in snap.nodes for g in n.gpus}
    jobs = {j.id: j for j in snap.queued}
    used = {n.name: [0.0, 0] for n in snap.nodes}
    held = [(a.job, {node_of[g] for g in a.gpu_ids}) for a in snap.running]
    held += [(jobs[s.job_id], {s.node} if s.node else {node_of[g] for g in s.gpu_ids}) for s in plan.starts]
    for j, where in held:
        for name in where:
            used[name][0] += j.cpus
            used[name][1] += j.memory_mb
    cfg = snap.config
    for n in snap.nodes:
        assert used[n.name][0] <= n.cpus - cfg.node_reserved_cpus + 1e-6, (n.name, used)
        assert used[n.name][1] <= n.memory_mb - cfg.node_reserved_memory_mb, (n.name, used)
    for s in plan.starts:  # every CPU-only start names its node; a GPU start none
        assert (s.node is not None) == (not s.gpu_ids)
    for job_id, reason in plan.waiting.items():
        assert reason.code and reason.message
