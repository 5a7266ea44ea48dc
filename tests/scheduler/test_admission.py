"""Who may start at all: quotas, borrowing, budgets, types, arrays, deps."""
from scheduler.core import OrgQuota, schedule

from .factories import job, nodes, quota, running, snapshot, started


def test_project_max_gpus_counts_running_jobs():
    busy = [running(job("r", 4), [f"n0-{i}" for i in range(4)])]
    plan = schedule(snapshot(nodes(2), [job("a", 2)], busy, projects={"alice": quota("alice", 4, 4)}))
    assert plan.starts == []
    reason = plan.waiting["a"]
    assert reason.code == "quota_project"
    assert reason.message == "Waiting for 2 GPUs: project quota 4/4 in use"
    assert reason.position == 1


def test_two_queued_jobs_cannot_share_the_same_quota_headroom():
    plan = schedule(snapshot(nodes(2), [job("a", 2, submit=1), job("b", 2, submit=2)],
                             projects={"alice": quota("alice", 3, 3)}, policy="fifo"))
    assert list(started(plan)) == ["a"]
    assert plan.waiting["b"].code == "quota_project"


def test_use_above_the_guarantee_is_borrowed():
    plan = schedule(snapshot(nodes(2), [job("a", 4, submit=1), job("b", 4, submit=2)],
                             projects={"alice": quota("alice", 6, 16)}, policy="fifo"))
    flags = {s.job_id: s.borrowed for s in plan.starts}
    assert flags == {"a": False, "b": True}


def test_jobs_within_guarantee_go_before_borrowers():
    # bob is older but would borrow; alice is within her guarantee (multifactor only).
    q = [job("bob1", 8, project="bob", submit=1), job("alice1", 8, project="alice", submit=2)]
    busy = [running(job("bobr", 8, project="bob"), [f"n0-{i}" for i in range(8)])]
    projects = {"alice": quota("alice", 8, 16), "bob": quota("bob", 8, 16)}
    plan = schedule(snapshot(nodes(2), q, busy, projects=projects, policy="multifactor", preemption=False))
    assert list(started(plan)) == ["alice1"]
    assert "guarantee" in plan.waiting["bob1"].message


def test_org_cap_applies_across_projects():
    q = [job("a", 4, project="alice", org="acme", submit=1), job("b", 4, project="bob", org="acme", submit=2)]
    projects = {"alice": quota("alice", 8, 8, org="acme"), "bob": quota("bob", 8, 8, org="acme")}
    plan = schedule(snapshot(nodes(2), q, projects=projects, orgs={"acme": OrgQuota("acme", 6)}, policy="fifo"))
    assert list(started(plan)) == ["a"]
    assert plan.waiting["b"].code == "quota_org"


def test_max_running_jobs():
    plan = schedule(snapshot(nodes(1), [job(f"j{i}", 1, submit=i) for i in range(3)],
                             projects={"alice": quota("alice", 8, 8, max_running_jobs=2)}, policy="fifo"))
    assert len(plan.starts) == 2
    assert plan.waiting["j2"].code == "max_running"


def test_time_limit_above_the_project_maximum():
    plan = schedule(snapshot(nodes(1), [job("a", 1, time_limit=7200)],
                             projects={"alice": quota("alice", 8, 8, max_time_limit=3600)}))
    assert plan.waiting["a"].code == "time_limit"
    assert "shorter" in plan.waiting["a"].message


def test_spent_budget_stops_gpu_jobs():
    projects = {"alice": quota("alice", 8, 8, gpu_hours_budget=100, gpu_hours_used=100)}
    plan = schedule(snapshot(nodes(1), [job("a", 1)], projects=projects))
    assert plan.starts == [] and plan.waiting["a"].code == "budget"
    projects["alice"].gpu_hours_used = 99
    assert list(started(schedule(snapshot(nodes(1), [job("a", 1)], projects=projects)))) == ["a"]


def test_allowed_gpu_types():
    cluster = nodes(1, model="A100", prefix="a") + nodes(1, model="H100", prefix="h")
    projects = {"alice": quota("alice", 16, 16, allowed_gpu_types=("A100",))}
    plan = schedule(snapshot(cluster, [job("x", 1, gpu_type="H100")], projects=projects))
    assert plan.waiting["x"].code == "gpu_type"
    plan = schedule(snapshot(cluster, [job("y", 8)], projects=projects))
    assert all(g.startswith("a0-") for g in started(plan)["y"])  # untyped job stays on allowed types


def test_dependencies_must_be_done():
    plan = schedule(snapshot(nodes(1), [job("a", 1, deps_satisfied=False)]))
    assert plan.starts == [] and plan.waiting["a"].code == "dependency"


def test_array_throttle_caps_running_tasks():
    busy = [running(job("t0", 1, array_parent="arr", array_limit=2), ["n0-0"])]
    q = [job(f"t{i}", 1, array_parent="arr", array_limit=2, submit=i) for i in range(1, 4)]
    plan = schedule(snapshot(nodes(1), q, busy, policy="fifo"))
    assert list(started(plan)) == ["t1"]
    assert plan.waiting["t2"].code == "array_throttle"
    assert plan.waiting["t3"].code == "array_throttle"


def test_unknown_project_has_no_limits_but_only_borrows():
    plan = schedule(snapshot(nodes(1), [job("a", 2, project="ghost")], projects={}))
    assert [s.borrowed for s in plan.starts] == [True]


def test_every_waiting_job_has_a_reason_and_a_position():
    q = [job(f"j{i}", 8, submit=i) for i in range(5)]
    plan = schedule(snapshot(nodes(1), q, policy="fifo"))
    assert list(started(plan)) == ["j0"]
    assert [plan.waiting[f"j{i}"].position for i in range(1, 5)] == [1, 2, 3, 4]
    assert all(r.message for r in plan.waiting.values())
