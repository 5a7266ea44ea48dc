"""A reference Tiresias two-dimensional LAS, independent of scheduler/core and scheduler/sim.

Tiresias (Gu et al., NSDI'19) orders jobs by attained service in two dimensions, GPUs x time
run, discretized into queues: a job's queue is how many thresholds (GPU-seconds) its attained
service has reached, lower queues first, FIFO (submit time) within a queue. At every event the
whole set of active jobs is re-sorted and admitted greedily while GPUs last (a job that does
not fit is skipped, later ones may still start); running jobs left out are preempted. A job
that has run and then waited longer than `starve` x the time it ran is promoted to the first
queue (the starvation guard).

GPU count only: the cluster is a pool of `capacity` GPUs, no nodes, no placement, no tenants,
no minimum runtime. `resume=True` resumes a preempted job where it stopped (Tiresias assumes
checkpoints); `resume=False` restarts it from zero, as the project's simulator does, and
counts the lost GPU-time. Events are exact: arrivals, completions, the instants a running job
crosses a threshold and a waiting job reaches its promotion time.

    .venv/bin/python bench/tiresias_ref.py --trace tests/scheduler/data/philly_dev.csv --gpus 64
"""
from __future__ import annotations

import argparse
import bisect
import csv
import math
from dataclasses import dataclass

INF = math.inf
EPS = 1e-6  # seconds / GPU-seconds: an event computed for an instant counts as reached there


@dataclass
class RefJob:
    id: str
    submit: float
    runtime: float  # seconds of work: the trace duration, cut at its walltime
    gpus: int
    tenant: str
    progress: float = 0.0  # seconds of work done (kept across preemptions only with resume)
    attained: float = 0.0  # GPU-seconds of service, all attempts
    ran: float = 0.0  # seconds run, all attempts (attained / gpus)
    queued_since: float = 0.0
    running: bool = False
    end: float | None = None
    first_start: float | None = None
    preempted: int = 0
    lost: float = 0.0  # GPU-seconds thrown away (resume=False)


def read_jobs(path: str, start_day: float | None = None, days: float | None = None) -> list[RefJob]:
    """Trace rows in the design's CSV format; fractional GPUs count as one GPU."""
    lo = start_day * 86400 if start_day is not None else -INF
    hi = lo + days * 86400 if (start_day is not None and days is not None) else INF
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            submit = float(row["submit_time"])
            if not lo <= submit < hi:
                continue
            duration = float(row["duration"])
            walltime = float(row.get("walltime") or 0)
            runtime = min(duration, walltime) if walltime > 0 else duration
            gpus = max(1, math.ceil(float(row["gpus"]) - 1e-9))
            out.append(RefJob(row["job_id"], submit, runtime, gpus, row["tenant"], queued_since=submit))
    return sorted(out, key=lambda j: (j.submit, j.id))


def simulate(jobs: list[RefJob], capacity: int, thresholds: tuple[float, ...] = (3600.0,),
             starve: float = 8.0, resume: bool = True) -> list[RefJob]:
    """Run the jobs (those larger than the cluster are left out) and return them, ended."""
    jobs = [j for j in jobs if j.gpus <= capacity]
    pending = list(jobs)  # not yet submitted, in submit order
    pending.reverse()
    active: list[RefJob] = []
    now = jobs[0].submit if jobs else 0.0

    def queue(j: RefJob) -> int:
        if not j.running and j.ran > 0 and now - j.queued_since >= starve * j.ran - EPS:
            return 0  # promoted
        return bisect.bisect_right(thresholds, j.attained + EPS)

    while pending or active:
        # 1. the next event
        t = pending[-1].submit if pending else INF
        for j in active:
            if j.running:
                t = min(t, now + j.runtime - j.progress)
                k = bisect.bisect_right(thresholds, j.attained + EPS)
                if k < len(thresholds):
                    t = min(t, now + (thresholds[k] - j.attained) / j.gpus)
            elif j.ran > 0 and now - j.queued_since < starve * j.ran - EPS:
                t = min(t, j.queued_since + starve * j.ran)
        t = max(t, now)
        # 2. advance the running jobs to it; 3. completions and arrivals
        dt = t - now
        now = t
        for j in active:
            if j.running:
                j.progress += dt
                j.attained += j.gpus * dt
                j.ran += dt
        for j in [j for j in active if j.running and j.progress >= j.runtime - EPS]:
            j.running, j.end = False, now
            active.remove(j)
        while pending and pending[-1].submit <= now:
            active.append(pending.pop())
        # 4. re-sort everything active, admit greedily, preempt what is left out
        order = sorted(active, key=lambda j: (queue(j), j.submit, j.id))
        free, keep = capacity, set()
        for j in order:
            if j.gpus <= free:
                keep.add(j.id)
                free -= j.gpus
        for j in active:
            if j.running and j.id not in keep:
                j.running, j.queued_since = False, now
                j.preempted += 1
                if not resume:
                    j.lost += j.gpus * j.progress
                    j.progress = 0.0
        for j in active:
            if not j.running and j.id in keep:
                j.running = True
                if j.first_start is None:
                    j.first_start = now
    return jobs


def summary(jobs: list[RefJob]) -> dict:
    done = [j for j in jobs if j.end is not None]
    jct = [j.end - j.submit for j in done]
    return {"jobs": len(done), "jct_mean": sum(jct) / len(jct) if jct else None,
            "preemptions": sum(j.preempted for j in jobs), "lost_gpu_hours": sum(j.lost for j in jobs) / 3600.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--start-day", type=float)
    ap.add_argument("--days", type=float)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--threshold-gpu-h", type=float, nargs="+", default=[1.0])
    ap.add_argument("--starve", type=float, default=8.0)
    ap.add_argument("--restart", action="store_true", help="preempted jobs restart from zero")
    a = ap.parse_args()
    jobs = read_jobs(a.trace, a.start_day, a.days)
    out = summary(simulate(jobs, a.gpus, tuple(h * 3600 for h in a.threshold_gpu_h), a.starve, not a.restart))
    print(f"{out['jobs']} jobs, mean JCT {out['jct_mean'] / 3600:.2f} h, {out['preemptions']} preemptions, "
          f"{out['lost_gpu_hours']:.1f} GPU-hours lost")


if __name__ == "__main__":
    main()
