"""Where jobs land: best fit vs spread, gangs, types, health, shared GPUs."""
from scheduler.core import GPU, Node, schedule

from .factories import job, nodes, running, snapshot, started


def test_bestfit_picks_the_node_left_with_the_fewest_free_gpus():
    cluster = nodes(3)
    busy = [running(job(f"r{i}", 1), [f"n1-{i}"]) for i in range(6)]  # n1 has 2 free
    busy += [running(job(f"s{i}", 1), [f"n2-{i}"]) for i in range(4)]  # n2 has 4 free
    plan = schedule(snapshot(cluster, [job("a", 2)], busy))
    assert started(plan)["a"] == ["n1-6", "n1-7"]


def test_spread_picks_the_least_used_node_then_the_coolest():
    cluster = nodes(3)
    for g in cluster[0].gpus:
        g.load = 0.9
    busy = [running(job("r1", 1), ["n1-0"])]
    plan = schedule(snapshot(cluster, [job("a", 2)], busy, placement="spread"))
    # n0 and n2 are both empty; n2 is cooler.
    assert all(g.startswith("n2-") for g in started(plan)["a"])


def test_pool_placement_overrides_the_default():
    cluster = nodes(2, pool="hot")
    cluster[0].gpus[0].load = 0.5
    busy = [running(job("r1", 1), ["n1-0"])]
    plan = schedule(snapshot(cluster, [job("a", 1)], busy, pool_placement={"hot": "spread"}))
    assert started(plan)["a"][0].startswith("n0-")  # bestfit would pick n1
    plan = schedule(snapshot(cluster, [job("a", 1)], busy))
    assert started(plan)["a"][0].startswith("n1-")


def test_a_gang_goes_on_one_node_when_one_has_room():
    cluster = nodes(2)
    busy = [running(job("r0", 4), [f"n0-{i}" for i in range(4)])]
    plan = schedule(snapshot(cluster, [job("a", 6)], busy))
    assert {g.split("-")[0] for g in started(plan)["a"]} == {"n1"}


def test_a_job_that_fits_only_if_split_waits_fragmented_and_is_never_split():
    cluster = nodes(3, per=2)
    busy = [running(job(f"r{i}", 1), [f"n{i}-0"]) for i in range(3)]  # one GPU free on each node
    plan = schedule(snapshot(cluster, [job("a", 2)], busy))
    assert plan.starts == [] and plan.fragmented == {"a": 3}
    assert plan.waiting["a"].code == "fragmented"
    assert plan.waiting["a"].message.startswith("fragmented: 3 GPUs free but no node has 2")
    # Not fragmented when too few GPUs are free at all: that is plain resources.
    busier = busy + [running(job("r9", 1), ["n1-1"]), running(job("r8", 1), ["n2-1"])]  # one GPU free
    plan = schedule(snapshot(cluster, [job("b", 2)], busier))
    assert plan.fragmented == {} and plan.waiting["b"].code == "resources"


def test_a_single_node_job_larger_than_every_node_is_unplaceable_and_says_how_to_span():
    plan = schedule(snapshot(nodes(4), [job("a", 16)]))
    assert plan.starts == [] and plan.waiting["a"].code == "unplaceable"
    assert "largest matching node has 8" in plan.waiting["a"].message
    assert "nodes and gpus_per_node" in plan.waiting["a"].message


def test_a_multi_node_job_gets_equal_gpus_on_exactly_its_nodes():
    cluster = nodes(4)
    busy = [running(job("r0", 2), ["n0-0", "n0-1"]), running(job("r1", 7), [f"n1-{i}" for i in range(7)])]
    plan = schedule(snapshot(cluster, [job("a", 16, nodes=2)], busy))
    assert sorted(started(plan)["a"]) == sorted([f"n2-{i}" for i in range(8)] + [f"n3-{i}" for i in range(8)])
    # Best fit: the nodes left with the least over (n0 has 6 free, then an empty node), 4 on each;
    # the first node's GPUs come first (it is the gang's master).
    plan = schedule(snapshot(cluster, [job("b", 8, nodes=2)], busy))
    ids = started(plan)["b"]
    assert ids[:4] == ["n0-2", "n0-3", "n0-4", "n0-5"] and len({g.split("-")[0] for g in ids[4:]}) == 1
    # Even a gang that would fit on one node spans exactly the nodes it asked for.
    plan = schedule(snapshot(cluster, [job("c", 2, nodes=2)], busy))
    assert len({g.split("-")[0] for g in started(plan)["c"]}) == 2


def test_a_multi_node_job_waits_fragmented_when_too_few_nodes_have_room():
    cluster = nodes(3, per=4)
    busy = [running(job("r0", 3), ["n0-0", "n0-1", "n0-2"]), running(job("r1", 1), ["n1-0"])]
    plan = schedule(snapshot(cluster, [job("a", 6, nodes=2)], busy))  # 3 free on n1, 4 on n2, 1 on n0
    assert started(plan)["a"][:3] == ["n1-1", "n1-2", "n1-3"]
    plan = schedule(snapshot(cluster, [job("b", 8, nodes=2)], busy))  # 8 free, but only n2 has 4
    assert plan.starts == [] and plan.waiting["b"].code == "fragmented"
    assert plan.waiting["b"].message.startswith("fragmented: 8 GPUs free but fewer than 2 nodes have 4 each")
    plan = schedule(snapshot(cluster, [job("c", 12, nodes=4)], busy))  # only 3 nodes in the cluster
    assert plan.waiting["c"].code == "unplaceable"


def test_spread_places_a_gang_on_the_least_used_nodes():
    cluster = nodes(3)
    busy = [running(job("r0", 1), ["n0-0"])]
    plan = schedule(snapshot(cluster, [job("a", 4, nodes=2)], busy, placement="spread"))
    assert {g.split("-")[0] for g in started(plan)["a"]} == {"n1", "n2"}


def test_a_gang_that_does_not_fit_starts_nowhere():
    cluster = nodes(2)
    busy = [running(job("r0", 8), [f"n0-{i}" for i in range(8)]), running(job("r1", 1), ["n1-0"])]
    plan = schedule(snapshot(cluster, [job("a", 8)], busy))
    assert plan.starts == []
    assert plan.waiting["a"].code == "resources"


def test_gpu_type_matches_the_gpu_model():
    cluster = nodes(1, model="A100", prefix="a") + nodes(1, model="H100", prefix="h")
    plan = schedule(snapshot(cluster, [job("x", 2, gpu_type="H100")]))
    assert all(g.startswith("h0-") for g in started(plan)["x"])
    plan = schedule(snapshot(cluster, [job("y", 1, gpu_type="B200")]))
    assert plan.waiting["y"].code == "gpu_type"


def test_unhealthy_gpus_and_unschedulable_nodes_get_nothing():
    cluster = nodes(2, per=2)
    cluster[0].schedulable = False
    cluster[1].gpus[0].healthy = False
    plan = schedule(snapshot(cluster, [job("a", 1), job("b", 1, submit=1)], policy="fifo"))
    assert started(plan) == {"b": ["n1-1"]}
    assert plan.waiting["a"].code == "resources"


def test_fractions_pack_on_shared_gpus_and_never_exceed_one():
    cluster = nodes(1, per=2, shared=True)
    q = [job(f"f{i}", 0.4, submit=i) for i in range(5)]
    plan = schedule(snapshot(cluster, q, policy="fifo"))
    per_gpu: dict[str, float] = {}
    for s in plan.starts:
        (gid,) = s.gpu_ids
        per_gpu[gid] = per_gpu.get(gid, 0) + s.fractions[gid]
    assert len(plan.starts) == 4  # two 0.4s per GPU; a third would be 1.2
    assert all(v <= 1.0 + 1e-9 for v in per_gpu.values())
    assert started(plan)["f0"] == started(plan)["f1"]  # packed, not spread


def test_fractions_pack_by_memory_when_asked():
    cluster = nodes(1, per=1, shared=True, memory_mb=16000)
    q = [job("m1", 0.1, gpu_memory_mb=10000, submit=1), job("m2", 0.1, gpu_memory_mb=8000, submit=2)]
    plan = schedule(snapshot(cluster, q, policy="fifo"))
    assert list(started(plan)) == ["m1"]  # 10 GB + 8 GB do not fit in 16 GB


def test_fractional_jobs_never_go_on_exclusive_gpus():
    plan = schedule(snapshot(nodes(1), [job("f", 0.5)]))
    assert plan.starts == []
    assert plan.waiting["f"].code == "unplaceable"


def test_whole_gpu_jobs_prefer_exclusive_gpus_and_may_use_a_free_shared_one():
    cluster = [Node("x", "default", [GPU("x-0", "x", 0, "A100", 80000, shared=True),
                                     GPU("x-1", "x", 1, "A100", 80000)])]
    plan = schedule(snapshot(cluster, [job("a", 1), job("b", 1, submit=0)], policy="fifo"))
    assert started(plan) == {"b": ["x-1"], "a": ["x-0"]}


def test_cpu_only_jobs_start_without_gpus():
    cluster = nodes(1, per=1)
    busy = [running(job("r", 1), ["n0-0"])]
    plan = schedule(snapshot(cluster, [job("cpu", 0)], busy))
    assert started(plan) == {"cpu": []}


def test_a_job_runs_only_in_the_sandbox_it_asks_for():
    cluster = nodes(1, prefix="d") + nodes(1, prefix="k")
    for g in cluster[0].gpus:
        g.sandbox = "docker"
    for g in cluster[1].gpus:
        g.sandbox = "kvm"
    busy = [running(job(f"r{i}", 1), [f"k0-{i}"]) for i in range(6)]  # best fit would prefer k0
    plan = schedule(snapshot(cluster, [job("vm", 2, sandbox="kvm"), job("ct", 2)], busy))
    assert [g[:2] for g in started(plan)["vm"]] == ["k0", "k0"]
    assert [g[:2] for g in started(plan)["ct"]] == ["d0", "d0"]
    # A kvm job in a cluster without kvm nodes waits, and says why.
    plan = schedule(snapshot(cluster[:1], [job("vm", 1, sandbox="kvm")], []))
    assert plan.starts == [] and plan.waiting["vm"].code == "sandbox"
    assert "kvm sandbox" in plan.waiting["vm"].message
