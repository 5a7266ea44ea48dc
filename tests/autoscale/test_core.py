"""The pure autoscaling decisions (scheduler/core/autoscale.py), on snapshots built by hand."""
from scheduler.core import GPU, Allocation, Job, Node, Snapshot, schedule
from scheduler.core.autoscale import BOOTING, READY, RELEASING, PoolNode, PoolSpec, autoscale


def job(i, gpus=1, t=0.0, limit=3600.0, project="p", gpu_type=None, nodes=1):
    return Job(str(i), project, "o", "u", gpus, t, limit, gpu_type=gpu_type, nodes=nodes, sandbox="process")


def node(name, gpus=8, model="H100-80GB", pool="h100"):
    return Node(name, pool, [GPU(f"{name}/{k}", name, k, model, 81920, sandbox="process") for k in range(gpus)],
                sandbox="process")


def pool(**kw):
    base = dict(name="h100", gpu_model="H100-80GB", gpus_per_node=8, price_per_gpu_hour=2.0, max_nodes=16,
                max_per_step=16, idle_release_s=300, boot_estimate_s=60, sandbox="process")
    return PoolSpec(**{**base, **kw})


def run(nodes, queued, pools, pool_nodes=(), running=(), now=1000.0, budgets=None):
    snap = Snapshot(now, list(nodes), list(running), list(queued), {}, {}, {})
    return autoscale(snap, schedule(snap), pools, list(pool_nodes), budgets, now)


def test_64_one_gpu_jobs_on_an_empty_pool_ask_for_8_nodes_of_8():
    out = run([], [job(i) for i in range(64)], [pool()])
    up = out.up["h100"]
    assert up.nodes == 8 and up.wanted == 8 and not up.limited_by
    assert sorted(len(j) for j in up.jobs) == [8] * 8
    assert out.demand_gpus == {"h100": 64.0}


def test_limits_cap_the_step_and_the_pool_and_say_so():
    out = run([], [job(i, gpus=8) for i in range(10)], [pool(max_per_step=3)])
    assert out.up["h100"].nodes == 3 and "at most 3 nodes at a time" in out.up["h100"].limited_by
    waiting_notes = [n for n in out.notes.values() if "no node added" in n]
    assert len(waiting_notes) == 7
    out = run([], [job(i, gpus=8) for i in range(10)],
              [pool(max_nodes=4)], [PoolNode(f"h100-{k}", "h100", READY, 0.0) for k in range(2)])
    assert out.up["h100"].nodes == 2 and "maximum of 4 nodes" in out.up["h100"].limited_by
    # A cost cap of 40 an hour at 2 per GPU-hour: 2 nodes of 8 GPUs.
    out = run([], [job(i, gpus=8) for i in range(10)], [pool(max_cost_per_hour=40.0)])
    assert out.up["h100"].nodes == 2 and "cap of 40 an hour" in out.up["h100"].limited_by


def test_booting_nodes_and_work_ending_soon_are_counted_before_new_nodes():
    booting = [PoolNode("h100-1", "h100", BOOTING, 990.0)]
    registering = node("h100-1")
    registering.schedulable = False  # its agent has not registered yet
    out = run([registering], [job(i, t=float(i)) for i in range(12)], [pool()], booting)
    assert out.on_booting == {"h100-1": [str(i) for i in range(8)]}
    assert out.up["h100"].nodes == 1 and out.up["h100"].jobs == [[str(i) for i in range(8, 12)]]
    # A full node whose 8 jobs end within the boot estimate takes the next 8: no new node.
    busy = node("h100-2")
    running = [Allocation(job(100 + k, limit=30.0), [f"h100-2/{k}"], 990.0) for k in range(8)]
    out = run([busy], [job(i) for i in range(8)], [pool()], [PoolNode("h100-2", "h100", READY, 0.0)], running)
    assert "h100" not in out.up
    # Ending in an hour: not soon, a node is added.
    running = [Allocation(job(100 + k, limit=3600.0), [f"h100-2/{k}"], 990.0) for k in range(8)]
    out = run([busy], [job(i) for i in range(8)], [pool()], [PoolNode("h100-2", "h100", READY, 0.0)], running)
    assert out.up["h100"].nodes == 1


def test_jobs_go_to_the_cheapest_pool_that_fits_and_tenant_limits_add_nothing():
    cheap = pool(name="a10", gpu_model="A10-24GB", gpus_per_node=4, price_per_gpu_hour=0.5)
    out = run([], [job(1), job(2, gpu_type="H100"), job(3, gpus=8)], [pool(), cheap])
    assert out.up["a10"].jobs == [["1"]]
    assert out.up["h100"].nodes == 2 and out.demand_gpus == {"a10": 1.0, "h100": 9.0}
    # A project with 1.5 GPU-hours of budget left gets one 1-GPU hour-long job's node, not a second.
    out = run([], [job(1), job(2)], [pool()], budgets={"p": 1.5})
    assert out.up["h100"].nodes == 1 and out.up["h100"].jobs == [["1"]]
    assert "0.5 GPU-hours of budget left" in out.notes["2"]


def test_a_backed_off_pool_adds_nothing_and_says_until_when():
    out = run([], [job(1)], [pool(available=False, unavailable_note="pool h100 is unavailable until 10:00:00 UTC")])
    assert "h100" not in out.up and out.notes["1"].startswith("pool h100 is unavailable until 10:00:00")


def test_idle_nodes_are_released_longest_idle_first_within_the_limits():
    nodes = [PoolNode("h100-1", "h100", READY, 0.0, idle_since=100.0),
             PoolNode("h100-2", "h100", READY, 0.0, idle_since=500.0),
             PoolNode("h100-3", "h100", READY, 0.0, idle_since=800.0),  # idle 200 s < 300 s
             PoolNode("h100-4", "h100", READY, 0.0, idle_since=None),  # busy
             PoolNode("h100-5", "h100", READY, 0.0, idle_since=50.0)]
    out = run([], [], [pool(max_concurrent_releases=2)], nodes)
    assert out.release == ["h100-5", "h100-1"]
    # One release already under way: one more.
    out = run([], [], [pool(max_concurrent_releases=2)], nodes + [PoolNode("h100-9", "h100", RELEASING, 0.0)])
    assert out.release == ["h100-5"]
    # Never below min_nodes (5 live, min 4).
    out = run([], [], [pool(min_nodes=4, max_concurrent_releases=5)], nodes)
    assert out.release == ["h100-5"]
    # Jobs the pool could serve wait: nothing is released.
    out = run([], [job(1, gpus=8)], [pool(max_concurrent_releases=5)], nodes)
    assert out.release == []


def test_min_nodes_are_kept_without_demand():
    out = run([], [], [pool(min_nodes=2)])
    assert out.up["h100"].nodes == 2 and out.up["h100"].wanted == 0


def test_a_lightly_used_node_of_movable_jobs_is_consolidated_onto_the_others():
    a, b = node("h100-1"), node("h100-2")
    running = [Allocation(job(100 + k), [f"h100-1/{k}"], 0.0) for k in range(4)]  # a: half busy, not movable
    running += [Allocation(job(200), ["h100-2/0"], 0.0), Allocation(job(201, gpus=2), ["h100-2/1", "h100-2/2"], 0.0)]
    pool_nodes = [PoolNode("h100-1", "h100", READY, 0.0), PoolNode("h100-2", "h100", READY, 0.0)]

    def plan(movable, now=1000.0, **kw):
        snap = Snapshot(now, [a, b], running, [], {}, {}, {})
        return autoscale(snap, schedule(snap), [pool(**kw)], pool_nodes, None, now, movable=movable)

    assert plan({"200", "201"}).consolidate == {"h100-2": ["200", "201"]}
    # A do-not-disrupt (or non-checkpointing) job on it: the node stays.
    assert plan({"200"}).consolidate == {}
    # A job started there within the idle time: it stays too.
    assert plan({"200", "201"}, now=200.0).consolidate == {}
    # No room left on the other node for all of them: nothing moves.
    running += [Allocation(job(300 + k), [f"h100-1/{4 + k}"], 0.0) for k in range(2)]
    assert plan({"200", "201"}).consolidate == {}


def test_jobs_beyond_their_quota_ask_for_no_node():
    """On an empty cluster every job passes admission alone; only those within the project's max
    GPUs and running jobs, and the organization's max, count as demand."""
    from scheduler.core import OrgQuota, ProjectQuota

    queued = [job(i, t=float(i)) for i in range(64)]
    snap = Snapshot(1000.0, [], [], queued, {"p": ProjectQuota("p", "o", 8, 16, max_running_jobs=20)}, {}, {})
    out = autoscale(snap, schedule(snap), [pool()], [], None, 1000.0)
    assert out.up["h100"].nodes == 2 and out.demand_gpus == {"h100": 16.0}
    snap = Snapshot(1000.0, [], [], queued, {}, {"o": OrgQuota("o", 24)}, {})
    assert autoscale(snap, schedule(snap), [pool()], [], None, 1000.0).up["h100"].nodes == 3
