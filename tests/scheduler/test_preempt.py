"""Preemption: only for a job within its guarantee, only of eligible victims."""
from scheduler.core import schedule

from .factories import NOW, job, nodes, quota, running, snapshot

PROJECTS = {"alice": quota("alice", 8, 16), "bob": quota("bob", 8, 16)}


def full_of_bob(borrowed_all=True, start=NOW - 3600, preemptible=False):
    """Two nodes: bob holds all 16 GPUs, the second node's 8 above his guarantee."""
    return [running(job("bob-own", 8, project="bob"), [f"n0-{i}" for i in range(8)], start=start),
            running(job("bob-lent", 8, project="bob", preemptible=preemptible), [f"n1-{i}" for i in range(8)],
                    start=start, borrowed=borrowed_all)]


def test_a_job_within_its_guarantee_preempts_borrowed_work():
    plan = schedule(snapshot(nodes(2), [job("a", 8)], full_of_bob(), projects=PROJECTS))
    assert [(p.job_id, p.by_job_id) for p in plan.preemptions] == [("bob-lent", "a")]
    assert plan.waiting["a"].code == "preempting"
    assert plan.starts == []


def test_no_preemption_before_the_minimum_runtime():
    plan = schedule(snapshot(nodes(2), [job("a", 8)], full_of_bob(start=NOW - 60), projects=PROJECTS))
    assert plan.preemptions == []
    assert plan.reservations[0].job_id == "a"


def test_no_preemption_for_a_job_above_its_guarantee():
    busy = full_of_bob()
    busy.append(running(job("alice-r", 0), []))
    projects = {"alice": quota("alice", 4, 16), "bob": quota("bob", 8, 16)}
    plan = schedule(snapshot(nodes(2), [job("a", 8)], busy, projects=projects))
    assert plan.preemptions == []


def test_work_within_its_own_guarantee_is_never_preempted():
    plan = schedule(snapshot(nodes(2), [job("a", 8)], full_of_bob(borrowed_all=False), projects=PROJECTS))
    assert plan.preemptions == []


def test_borrowed_work_of_a_project_back_under_its_guarantee_is_kept():
    projects = {"alice": quota("alice", 8, 16), "bob": quota("bob", 16, 16)}
    plan = schedule(snapshot(nodes(2), [job("a", 8)], full_of_bob(), projects=projects))
    assert plan.preemptions == []


def test_preemptible_lower_qos_work_yields_to_higher_qos():
    busy = full_of_bob(borrowed_all=False, preemptible=True)
    plan = schedule(snapshot(nodes(2), [job("a", 8, qos=1)], busy, projects=PROJECTS))
    assert [p.job_id for p in plan.preemptions] == ["bob-lent"]
    plan = schedule(snapshot(nodes(2), [job("a", 8, qos=0)], busy, projects=PROJECTS))
    assert plan.preemptions == []


def test_the_fewest_and_cheapest_victims_are_chosen():
    cluster = nodes(2)
    busy = [running(job("bob-own", 8, project="bob"), [f"n0-{i}" for i in range(8)])]
    busy += [running(job(f"c{i}", 2, project="carol"), [f"n1-{2 * i}", f"n1-{2 * i + 1}"],
                     start=NOW - 1000 * (i + 1), borrowed=True) for i in range(4)]
    projects = dict(PROJECTS, carol=quota("carol", 0, 16))
    plan = schedule(snapshot(cluster, [job("a", 4)], busy, projects=projects))
    assert sorted(p.job_id for p in plan.preemptions) == ["c0", "c1"]  # the two that ran least


def test_preemption_off():
    plan = schedule(snapshot(nodes(2), [job("a", 8)], full_of_bob(), projects=PROJECTS, preemption=False))
    assert plan.preemptions == []


def test_preemption_gathers_a_fragmented_jobs_gpus_on_one_node_and_says_so():
    """Two free GPUs, one per node: alice's 2-GPU job preempts one borrowed job so that both of
    its GPUs are on one node, never taking the free GPU of the other node."""
    cluster = nodes(2, per=2)
    busy = [running(job("b0", 1, project="bob"), ["n0-0"], borrowed=True, start=NOW - 5000),
            running(job("b1", 1, project="bob"), ["n1-0"], borrowed=True, start=NOW - 1000)]
    projects = {"alice": quota("alice", 2, 4), "bob": quota("bob", 0, 4)}
    plan = schedule(snapshot(cluster, [job("a", 2)], busy, projects=projects))
    assert [p.job_id for p in plan.preemptions] == ["b1"]  # the cheaper one: less work lost
    assert plan.fragmented == {"a": 2} and plan.waiting["a"].code == "preempting"
    assert "on one node (enough GPUs are free, but spread over other nodes)" in plan.waiting["a"].message


def test_a_multi_node_job_preempts_on_exactly_the_nodes_it_lacks():
    cluster = nodes(3, per=2)
    busy = [running(job("b0", 2, project="bob"), ["n0-0", "n0-1"], borrowed=True, start=NOW - 5000),
            running(job("b1", 2, project="bob"), ["n1-0", "n1-1"], borrowed=True, start=NOW - 1000)]
    projects = {"alice": quota("alice", 4, 6), "bob": quota("bob", 0, 6)}
    plan = schedule(snapshot(cluster, [job("a", 4, nodes=2)], busy, projects=projects))
    assert [p.job_id for p in plan.preemptions] == ["b1"]  # n2 is free; one more node is enough
