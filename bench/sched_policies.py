"""Queue policies on a Philly trace: the core's policies through the simulator, beside the
reference Tiresias 2D-LAS of bench/tiresias_ref.py (independent of the core, GPU count only).

    .venv/bin/python bench/sched_policies.py                      # the slice kept in the repository
    .venv/bin/python bench/sched_policies.py --trace $TRACES/philly_dev.csv --quota $TRACES/philly_vc_quota.csv \\
        --start-day 24 --days 7 --gpus 512                        # a full trace, a week of it

Rows: strict FIFO and first-fit FIFO (both without quotas: the plain baselines), multifactor
(the production default: quotas on, EASY backfill), las (quotas on; under las they neither
reorder nor preempt, so it is the same without), multifactor and las again with every job
checkpointing (`--checkpoint-interval`, `--checkpoint-grace`: a preempted job resumes from its
last checkpoint and loses the time since it plus the grace), and the
reference LAS resuming preempted jobs without loss (as Tiresias assumes) and restarting them
from zero (as our simulator does). Columns: mean JCT, mean wait (every wait), GPU-hours lost to
preemption and that as a share of capacity x the submission window, preemptions, and the worst
tenant's fairness (mean JCT shared / alone on its guarantee or an equal share; not computed for
the reference). Ratios at the end: multifactor / strict FIFO and las / reference LAS.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scheduler.sim.runner import ReplaySpec, replay  # noqa: E402
from tiresias_ref import read_jobs, simulate, summary  # noqa: E402

DATA = ROOT / "tests" / "scheduler" / "data"
CORE_RUNS = [
    ("fifo (strict, no quotas)", dict(policy="fifo", quotas=False)),
    ("fifo-backfill (first fit, no quotas)", dict(policy="fifo-backfill", quotas=False)),
    ("multifactor (default)", dict(policy="multifactor")),
    ("las", dict(policy="las")),  # quotas on as in production; under las they only cap and mark borrowing
    ("multifactor, jobs checkpoint", dict(policy="multifactor", checkpoint=True)),
    ("las, jobs checkpoint", dict(policy="las", checkpoint=True)),
]


def _core(spec: ReplaySpec) -> dict:
    return replay(spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DATA / "philly_dev.csv"))
    ap.add_argument("--quota", default=str(DATA / "philly_vc_quota.csv"))
    ap.add_argument("--start-day", type=float)
    ap.add_argument("--days", type=float)
    ap.add_argument("--gpus", type=int, default=48)
    ap.add_argument("--threshold-gpu-h", type=float, nargs="+", default=[1.0], help="las queue thresholds")
    ap.add_argument("--starve", type=float, default=8.0, help="las starvation factor K")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-fairness", action="store_true")
    ap.add_argument("--checkpoint-interval", type=float, default=1800.0, metavar="S",
                    help="checkpoint rows: every job saves every S seconds of its run (0: when signalled)")
    ap.add_argument("--checkpoint-grace", type=float, default=120.0, metavar="S",
                    help="checkpoint rows: seconds a preempted job gets to save, counted as lost")
    a = ap.parse_args()
    thresholds = tuple(h * 3600 for h in a.threshold_gpu_h)

    def spec(kw: dict) -> ReplaySpec:
        kw = dict(kw)
        if kw.pop("checkpoint", False):
            kw.update(checkpoint_interval_s=a.checkpoint_interval, checkpoint_grace_s=a.checkpoint_grace)
        return ReplaySpec(trace=a.trace, quota=a.quota, start_day=a.start_day, days=a.days, gpus=a.gpus,
                          fairness=not a.no_fairness, explain=False, las_thresholds_gpu_s=thresholds,
                          las_starvation_factor=a.starve, **kw)

    specs = [spec(kw) for _, kw in CORE_RUNS]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.workers) as ex:
        core = list(ex.map(_core, specs))
    jobs = read_jobs(a.trace, a.start_day, a.days)
    refs = [summary(simulate([*map(_copy, jobs)], a.gpus, thresholds, a.starve, resume))
            for resume in (True, False)]
    window = (jobs[-1].submit - jobs[0].submit) if jobs else 0.0
    print(f"{Path(a.trace).name}, days {a.start_day if a.start_day is not None else 'all'}"
          f"{f' +{a.days:g}' if a.days else ''}, {a.gpus} GPUs, {core[0]['jobs']} jobs "
          f"(reference: {refs[0]['jobs']}), las thresholds {', '.join(f'{h:g}' for h in a.threshold_gpu_h)} "
          f"GPU-h, starvation factor {a.starve:g}; checkpoint rows: every {a.checkpoint_interval:g} s, "
          f"grace {a.checkpoint_grace:g} s")
    head = f"{'policy':<38}{'jct_mean_h':>11}{'wait_h':>8}{'lost_gpu_h':>11}{'lost_%':>8}{'preempt':>8}{'fair_max':>9}"
    print(head)
    print("-" * len(head))
    for (name, _), r in zip(CORE_RUNS, core):
        fair = f"{r['fairness_max']:.2f}" if r["fairness_max"] is not None else "-"
        print(f"{name:<38}{r['jct_mean'] / 3600:>11.2f}{r['wait_mean'] / 3600:>8.2f}{r['lost_gpu_hours']:>11.1f}"
              f"{r['lost_capacity']:>8.1%}{r['preemptions']:>8}{fair:>9}")
    for name, r in zip(("reference 2D-LAS (resume)", "reference 2D-LAS (restart)"), refs):
        lost = r["lost_gpu_hours"] * 3600 / (a.gpus * window) if window else 0.0
        print(f"{name:<38}{r['jct_mean'] / 3600:>11.2f}{'-':>8}{r['lost_gpu_hours']:>11.1f}{lost:>8.1%}"
              f"{r['preemptions']:>8}{'-':>9}")
    by = dict(zip((n for n, _ in CORE_RUNS), core))
    mf, fifo = by["multifactor (default)"], by["fifo (strict, no quotas)"]
    print()
    print(f"utilization under multifactor {mf['utilization']:.1%}")
    print(f"multifactor / strict fifo mean JCT: {mf['jct_mean'] / fifo['jct_mean']:.2f}   (target <= 0.35)")
    las = by["las"]["jct_mean"]
    print(f"las / reference LAS mean JCT: {las / refs[0]['jct_mean']:.2f} (reference resumes without loss: "
          f"not like with like), {las / refs[1]['jct_mean']:.2f} (reference restarts from zero, as ours do: "
          f"like with like)   (target <= 1.0)")
    ck = by["las, jobs checkpoint"]
    print(f"las with checkpoints / reference LAS (resume) mean JCT: {ck['jct_mean'] / refs[0]['jct_mean']:.2f}"
          f"   (near like with like: ours loses the time since a job's last save and its grace)   (target <= 1.0)")
    worst = max(by[n]["lost_capacity"] for n in ("multifactor, jobs checkpoint", "las, jobs checkpoint"))
    print(f"lost to preemption when jobs checkpoint: at most {worst:.2%} of capacity   (target < 2%)")
    fair = [by[n]["fairness_max"] for n, _ in CORE_RUNS if by[n]["fairness_max"] is not None]
    if fair:
        print(f"fairness_max: multifactor {by['multifactor (default)']['fairness_max']:.2f}, "
              f"with checkpoints {by['multifactor, jobs checkpoint']['fairness_max']:.2f}; las "
              f"{by['las']['fairness_max']:.2f}, with checkpoints {by['las, jobs checkpoint']['fairness_max']:.2f}"
              f"   (target <= 1.1)")
    print(f"wall {time.perf_counter() - t0:.1f} s")


def _copy(j):
    return type(j)(j.id, j.submit, j.runtime, j.gpus, j.tenant, queued_since=j.submit)


if __name__ == "__main__":
    main()
