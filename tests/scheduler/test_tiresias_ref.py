"""The reference Tiresias 2D-LAS of bench/tiresias_ref.py on hand-computed traces (the bench
compares `las` with it, so it must be right on its own)."""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tiresias_ref", Path(__file__).resolve().parents[2] / "bench" / "tiresias_ref.py")
ref = sys.modules.setdefault("tiresias_ref", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(ref)


def run(jobs, capacity, **kw):
    out = ref.simulate([ref.RefJob(i, s, r, g, "t", queued_since=s) for i, s, r, g in jobs], capacity, **kw)
    return {j.id: j for j in out}


def test_a_new_job_preempts_the_job_past_the_threshold_which_resumes_or_restarts():
    """a (8 GPUs) passes 1 GPU-hour at 450 s; b arrives at 1000 s in the first queue and takes the
    cluster for 100 s; a resumes with 4000 s left, or restarts from zero and loses 8,000 GPU-s."""
    jobs = [("a", 0, 5000, 8), ("b", 1000, 100, 8)]
    res = run(jobs, 8, thresholds=(3600.0,))
    assert {k: (j.end, j.preempted, j.lost) for k, j in res.items()} == {"a": (5100, 1, 0), "b": (1100, 0, 0)}
    res = run(jobs, 8, thresholds=(3600.0,), resume=False)
    assert {k: (j.end, j.lost) for k, j in res.items()} == {"a": (6100, 8000), "b": (1100, 0)}
    assert ref.summary(list(res.values()))["lost_gpu_hours"] == 8000 / 3600


def test_a_starving_job_is_promoted_after_waiting_k_times_its_run_time():
    """a ran 150 s (queue 1) when short jobs start arriving; after waiting 2 x 150 s it is promoted
    at 450 s, preempts e (queue 0 but submitted later) and finishes; e resumes."""
    jobs = [("a", 0, 200, 1), ("b", 150, 90, 1), ("c", 200, 90, 1), ("d", 290, 90, 1), ("e", 400, 90, 1)]
    res = run(jobs, 1, thresholds=(100.0,), starve=2.0)
    assert {k: j.end for k, j in res.items()} == {"a": 500, "b": 240, "c": 330, "d": 420, "e": 560}
    assert res["e"].preempted == 1 and res["a"].preempted == 1
    # without the guard (a huge factor) a waits for every short job
    res = run(jobs, 1, thresholds=(100.0,), starve=1e9)
    assert res["a"].end == 560


def test_a_job_that_does_not_fit_is_skipped_not_blocking():
    res = run([("big", 0, 100, 8), ("wide", 1, 100, 8), ("small", 2, 50, 2)], 10)
    assert (res["wide"].first_start, res["small"].first_start) == (100, 2)
