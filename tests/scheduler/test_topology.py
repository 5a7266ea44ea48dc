"""Within a node, a multi-GPU job gets the most closely linked free GPUs the probe reported."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.core import GPU, Node, schedule
from scheduler.core.placement import TOPO_LEVELS, topo_level, topo_score

from .factories import job, running, snapshot, started


def dgx(name: str = "n0", per: int = 8, group: int = 4) -> Node:
    """Two NVLink groups of `group`, a PCIe switch per pair, a NUMA node per group (as the simulated probe)."""
    return Node(name, "default", [GPU(f"{name}-{k}", name, k, "H100", 81920, topo=(k // group, k // 2, k // group))
                                  for k in range(per)])


def test_a_two_gpu_job_lands_inside_one_nvlink_group():
    node = dgx()
    busy = [running(job("r0", 1), ["n0-0"]), running(job("r4", 1), ["n0-4"])]
    plan = schedule(snapshot([node], [job("a", 2)], busy))
    ids = started(plan)["a"]
    assert topo_level([g for g in node.gpus if g.id in ids]) == 0
    # Without topology the lowest free indexes would be taken (1 and 5 here); 5 and 6 share group 1.
    busy += [running(job(f"b{k}", 1), [f"n0-{k}"]) for k in (2, 3, 7)]
    plan = schedule(snapshot([node], [job("a", 2)], busy))
    assert started(plan)["a"] == ["n0-5", "n0-6"]


def test_a_four_gpu_job_takes_a_whole_free_group():
    node = dgx()
    busy = [running(job("r1", 1), ["n0-1"])]
    plan = schedule(snapshot([node], [job("a", 4)], busy))
    assert started(plan)["a"] == ["n0-4", "n0-5", "n0-6", "n0-7"]


def test_best_fit_within_a_node_keeps_the_larger_group_whole():
    node = dgx()
    busy = [running(job(f"r{k}", 1), [f"n0-{k}"]) for k in (0, 1)]  # group 0 has 2 free, group 1 has 4
    plan = schedule(snapshot([node], [job("a", 2), job("b", 4, submit=0)], busy))
    assert started(plan)["a"] == ["n0-2", "n0-3"] and started(plan)["b"] == ["n0-4", "n0-5", "n0-6", "n0-7"]


def test_when_no_nvlink_group_or_pcie_switch_has_room_one_numa_node_does():
    node = Node("n0", "default", [GPU(f"n0-{k}", "n0", k, "H100", 81920, topo=(k, k // 2, k // 4)) for k in range(8)])
    plan = schedule(snapshot([node], [job("a", 3)], [running(job("r", 1), ["n0-4"])]))
    # No NVLink group or PCIe switch holds 3; NUMA node 1 has exactly 3 free (best fit), node 0 stays whole.
    assert started(plan)["a"] == ["n0-5", "n0-6", "n0-7"]
    assert topo_score([g for g in node.gpus if g.id in started(plan)["a"]]) == TOPO_LEVELS.index("numa")


def test_score_is_unknown_without_topology_and_worst_over_a_gangs_nodes():
    plain = [GPU("a-0", "a", 0, "H100", 1), GPU("a-1", "a", 1, "H100", 1)]
    assert topo_level(plain) is None and topo_score(plain) is None
    linked = dgx("a").gpus[:2] + dgx("b").gpus[3:5]
    assert topo_score(linked) == TOPO_LEVELS.index("system")
    assert topo_score(linked[:2]) == 0


@st.composite
def topo_nodes(draw):
    n = draw(st.integers(2, 8))
    gpus = []
    for k in range(n):
        domains = tuple(draw(st.one_of(st.none(), st.integers(0, 2))) for _ in range(3))
        gpus.append(GPU(f"n0-{k}", "n0", k, "H100", 81920, topo=domains))
    busy = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    size = draw(st.integers(2, n - len(busy))) if n - len(busy) >= 2 else None
    return Node("n0", "default", gpus), sorted(busy), size


@settings(max_examples=300, deadline=None)
@given(topo_nodes(), st.sampled_from(["bestfit", "spread"]))
def test_property_the_chosen_gpus_are_as_closely_linked_as_any_free_set_of_that_size(case, placement):
    node, busy, size = case
    if size is None:
        return
    allocs = [running(job(f"r{k}", 1), [f"n0-{k}"]) for k in busy]
    plan = schedule(snapshot([node], [job("a", size)], allocs, placement=placement))
    ids = started(plan)["a"]
    assert len(ids) == size and not set(ids) & {f"n0-{k}" for k in busy}
    free = [g for g in node.gpus if g.index not in busy]
    best = min(topo_level(list(c)) for c in itertools.combinations(free, size))
    assert topo_level([g for g in node.gpus if g.id in ids]) == best
