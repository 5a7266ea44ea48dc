"""Queue order for each policy, and usage decay."""
import pytest

from scheduler.core import decay_usage, schedule

from .factories import NOW, job, nodes, quota, snapshot


def order_of(plan) -> list[str]:
    return [s.job_id for s in plan.starts]


def one_gpu_at_a_time(jobs, **kw):
    """With one free GPU the job started is the one first in order."""
    projects = {p: quota(p, 1, 1) for p in ("alice", "bob")}
    return schedule(snapshot(nodes(1, per=1), jobs, projects=projects, **kw))


def test_fifo_is_submit_order():
    plan = one_gpu_at_a_time([job("late", 1, submit=NOW - 10), job("early", 1, project="bob", submit=NOW - 20)],
                             policy="fifo")
    assert order_of(plan) == ["early"]
    assert plan.waiting["late"].position == 1


def test_las_prefers_the_job_with_least_attained_service_not_the_project_with_least_usage():
    jobs = [job("a", 1, submit=NOW - 50, attained_gpu_s=2 * 3600), job("b", 1, project="bob", submit=NOW - 10)]
    plan = one_gpu_at_a_time(jobs, policy="las", usage={"alice": 0.0, "bob": 1e6})
    assert order_of(plan) == ["b"]


def test_multifactor_fair_share_prefers_the_underserved_project():
    jobs = [job("a", 1, submit=NOW - 50), job("b", 1, project="bob", submit=NOW - 10)]
    plan = one_gpu_at_a_time(jobs, policy="multifactor", usage={"alice": 1e6, "bob": 0.0})
    assert order_of(plan) == ["b"]


def test_multifactor_qos_dominates():
    jobs = [job("a", 1, submit=NOW - 5000), job("b", 1, project="bob", submit=NOW - 10, qos=2)]
    plan = one_gpu_at_a_time(jobs, policy="multifactor", usage={"alice": 0.0, "bob": 1e6})
    assert order_of(plan) == ["b"]


def test_multifactor_favours_small_short_jobs():
    jobs = [job("big", 1, time_limit=72 * 3600, submit=NOW - 20), job("small", 1, time_limit=600, submit=NOW - 10)]
    plan = one_gpu_at_a_time(jobs, policy="multifactor")
    assert order_of(plan) == ["small"]


def test_multifactor_age_counts():
    jobs = [job("old", 1, submit=NOW - 6 * 86400), job("new", 1, submit=NOW - 10)]
    plan = one_gpu_at_a_time(jobs, policy="multifactor")
    assert order_of(plan) == ["old"]


def test_per_pool_policy():
    cluster = nodes(1, per=1, pool="p1", prefix="x") + nodes(1, per=1, pool="p2", prefix="y")
    jobs = [job("p1-old", 1, pool="p1", submit=NOW - 99, time_limit=86400),
            job("p1-short", 1, pool="p1", submit=NOW - 1, time_limit=60)]
    plan = schedule(snapshot(cluster, jobs, policy="multifactor", pool_policy={"p1": "fifo"}))
    assert order_of(plan) == ["p1-old"]


def test_unknown_policy_is_refused_with_its_name():
    with pytest.raises(ValueError, match="policy: unknown value 'sjf'"):
        schedule(snapshot(nodes(1), [job("a", 1)], policy="sjf"))


def test_decay_usage_halves_each_half_life():
    assert decay_usage(100.0, 7 * 86400, 7 * 86400) == pytest.approx(50.0)
    assert decay_usage(100.0, 14 * 86400, 7 * 86400) == pytest.approx(25.0)
    assert decay_usage(100.0, 0, 7 * 86400) == 100.0
