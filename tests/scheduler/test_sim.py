"""The trace simulator on a small slice of the Philly trace and a toy trace."""
import json
import math
from pathlib import Path

from scheduler.sim.__main__ import main
from scheduler.sim.engine import Simulator, make_projects
from scheduler.sim.metrics import summarize
from scheduler.sim.runner import ReplaySpec, replay
from scheduler.sim.trace import TraceJob, uniform_nodes
from scheduler.core import Config

# Slices of public GPU cluster traces kept in the repository (see data/README.md): no test depends on
# a folder outside the checkout, and none is skipped.
TRACES = Path(__file__).resolve().parent / "data"
KEYS = {"jobs", "jct_mean", "jct_p50", "jct_p95", "jct_p99", "wait_mean", "bounded_slowdown_mean",
        "utilization", "fragmentation", "fairness_max", "preemptions", "tenants"}



def test_toy_trace_runs_jobs_to_completion_and_measures_them():
    jobs = [TraceJob("a", 0, 100, 8, "t1", 3600), TraceJob("b", 0, 50, 8, "t2", 3600),
            TraceJob("c", 10, 30, 4, "t1", 3600), TraceJob("d", 20, 5000, 2, "t2", 100)]  # d hits its walltime
    sim = Simulator(jobs, uniform_nodes(8, 8), make_projects(["t1", "t2"], 8, None), Config(policy="fifo"))
    res = sim.run()
    ends = {k: r.end for k, r in res.records.items()}
    # a borrows the idle cluster; strict FIFO: at 100 b goes first although it borrows and c and d
    # are within their tenants' guarantees; at 150 c and d; d is killed at its walltime.
    assert ends == {"a": 100, "b": 150, "c": 180, "d": 250}
    assert res.records["d"].first_start == 150


def test_philly_slice_json_has_the_metrics_and_sane_numbers(capsys):
    main(["--trace", str(TRACES / "philly_dev.csv"), "--start-day", "48.5", "--days", "0.25", "--gpus", "64",
          "--policy", "multifactor", "--quota", str(TRACES / "philly_vc_quota.csv"), "--workers", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= set(out)
    assert out["jobs"] > 100
    assert 0 < out["utilization"] <= 1.0 + 1e-9
    assert 0 <= out["fragmentation"] <= 1.0
    assert 0 < out["jct_p50"] <= out["jct_p95"] <= out["jct_p99"]
    assert out["wait_mean"] >= 0 and out["bounded_slowdown_mean"] >= 1
    assert out["fairness_max"] is None or (math.isfinite(out["fairness_max"]) and out["fairness_max"] > 0)
    for m in out["tenants"].values():
        assert KEYS - {"tenants"} <= set(m)
        assert m["jobs"] > 0


def test_policies_differ_on_a_busy_slice():
    base = dict(trace=str(TRACES / "philly_dev.csv"), start_day=48.5, days=0.25, gpus=32, fairness=False)
    fifo = replay(ReplaySpec(policy="fifo", backfill=False, **base))
    mf = replay(ReplaySpec(policy="multifactor", **base))
    assert fifo["jobs"] == mf["jobs"]
    assert mf["jct_mean"] < fifo["jct_mean"]


def test_the_replay_is_the_same_with_and_without_production_reasons():
    base = dict(trace=str(TRACES / "philly_dev.csv"), start_day=48.5, days=0.25, gpus=32, fairness=False)
    for policy in ("fifo", "multifactor"):
        on, off = (replay(ReplaySpec(policy=policy, explain=e, **base)) for e in (True, False))
        for out in (on, off):
            for k in ("wall_s", "wall_s_shared"):
                out.pop(k)
        assert on == off


def test_alibaba_fractions_pack_on_shared_gpus():
    out = replay(ReplaySpec(trace=str(TRACES / "alibaba_shared_gpu.csv"), nodes=str(TRACES / "alibaba_nodes.csv"),
                            start_day=115, days=2, fairness=False))
    assert out["jobs"] > 100 and 0 < out["utilization"] <= 1.0 + 1e-9


def test_jobs_larger_than_a_node_replay_on_several_nodes_and_fragmented_waits_are_counted():
    """On 8-GPU nodes a 16-GPU trace job runs as 2 x 8 and a 12-GPU one as 2 x 6; 9 GPUs cannot be
    split evenly over 2 nodes and are skipped, counted. With spread placement the two 1-GPU jobs
    land on different nodes, so the 8-GPU job waits fragmented until the first ends."""
    jobs = [TraceJob("big", 0, 50, 16, "t1", 3600), TraceJob("odd", 0, 50, 12, "t1", 3600),
            TraceJob("nine", 0, 50, 9, "t1", 3600)]
    sim = Simulator(jobs, uniform_nodes(16, 8), make_projects(["t1"], 16, None), Config(policy="fifo"))
    res = sim.run()
    assert res.unsplittable == ["nine"] and res.multi_node == 2
    assert {k: r.end for k, r in res.records.items()} == {"big": 50, "odd": 100}
    jobs = [TraceJob("a", 0, 100, 1, "t1", 3600), TraceJob("b", 0, 300, 1, "t1", 3600),
            TraceJob("c", 1, 50, 8, "t1", 3600), TraceJob("d", 200, 10, 1, "t1", 3600)]  # d: window 0-200 s
    sim = Simulator(jobs, uniform_nodes(16, 8), make_projects(["t1"], 16, None),
                    Config(policy="fifo", placement="spread", explain=False))
    res = sim.run()
    assert res.records["c"].first_start == 100 and res.frag_jobs == {"c"} and res.frag_wait_s == 99
    out = summarize(res)
    assert out["fragmented_jobs"] == 1 and out["fragmented_wait_mean"] == 99
    assert math.isclose(out["fragmentation_split"], 14 * 99 / (16 * 200))  # 14 GPUs idle while c waited


def test_every_wait_counts_and_preempted_work_is_reported_lost():
    """a borrows the whole cluster; b, within t2's guarantee, preempts it at 1000 s and runs
    100 s; a waits again 100 s and restarts from zero."""
    jobs = [TraceJob("a", 0, 5000, 8, "t1", 90_000), TraceJob("b", 1000, 100, 4, "t2", 90_000)]
    res = Simulator(jobs, uniform_nodes(8, 8), make_projects(["t1", "t2"], 8, None), Config(policy="multifactor")).run()
    assert {k: (r.first_start, r.end, r.wait_s) for k, r in res.records.items()} == {
        "a": (0, 6100, 100), "b": (1000, 1100, 0)}
    out = summarize(res)
    assert out["wait_mean"] == 50 and out["first_wait_mean"] == 0
    assert out["preemptions"] == 1 and out["lost_gpu_hours"] == 8 * 1000 / 3600
    assert out["tenants"]["t1"]["lost_gpu_hours"] == 8 * 1000 / 3600 and out["tenants"]["t2"]["lost_gpu_hours"] == 0


def test_tenants_without_a_guarantee_count_in_fairness(tmp_path):
    """Only 6c71a0 has a quota here; the others are measured alone on an equal share of the cluster."""
    quota = tmp_path / "quota.csv"
    quota.write_text("vc,node num\n6c71a0,4\n")
    out = replay(ReplaySpec(trace=str(TRACES / "philly_dev.csv"), start_day=48.5, days=0.25, gpus=32, quota=str(quota)))
    assert len(out["tenants"]) > 2
    fair = {t: m["fairness"] for t, m in out["tenants"].items()}
    assert all(f is not None and f > 0 for f in fair.values()), fair
    assert out["fairness_max"] == max(fair.values())


def test_las_in_the_simulator_preempts_the_longest_served_job_and_remembers_its_service():
    """long has had 8 GPU-hours by 3600 s (queue 1), so short (queue 0) preempts it; long
    restarts from zero with its earlier service counted, and runs to the end after short."""
    jobs = [TraceJob("long", 0, 5000, 8, "t1", 90_000), TraceJob("short", 3600, 100, 8, "t2", 90_000)]
    cfg = Config(policy="las", las_thresholds_gpu_s=(3600.0,), min_runtime_s=600)
    sim = Simulator(jobs, uniform_nodes(8, 8), make_projects(["t1", "t2"], 8, None), cfg)
    res = sim.run()
    assert {k: (r.first_start, r.end, r.preempted) for k, r in res.records.items()} == {
        "long": (0, 3700 + 5000, 1), "short": (3600, 3700, 0)}
    assert res.lost_gpu_s == 8 * 3600


def test_las_in_the_simulator_acts_when_a_running_job_passes_a_threshold():
    """At 100 s both jobs are in the first queue, so short waits; long passes 1 GPU-hour at 450 s
    (8 GPUs): the replay runs a pass then, as production's periodic pass would, and short preempts it."""
    jobs = [TraceJob("long", 0, 5000, 8, "t1", 90_000), TraceJob("short", 100, 100, 8, "t2", 90_000)]
    cfg = Config(policy="las", las_thresholds_gpu_s=(3600.0,), min_runtime_s=300)
    res = Simulator(jobs, uniform_nodes(8, 8), make_projects(["t1", "t2"], 8, None), cfg).run()
    assert (res.records["short"].first_start, res.records["long"].preempted) == (450, 1)
