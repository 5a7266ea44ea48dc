"""Queue order: which job is considered first.

`fifo` and `fifo-backfill` are submit order (they differ in what a blocked
job does to later ones, see scheduling.py); `las` is Tiresias' discretized
two-dimensional least attained service: the job with the least GPU-service
(GPUs x time run, over all its attempts) first, in queues split at configured
thresholds, within a queue the project furthest below its fair share first, then FIFO, with a
starvation guard; `multifactor` is Slurm-like: a weighted sum of
QoS, fair share, age and size factors, each normalized to 0..1 first so the
weights alone say what matters.
"""
from __future__ import annotations

import bisect
import math

from .model import Allocation, Config, Job, ProjectQuota, Snapshot

POLICIES = ("fifo", "fifo-backfill", "multifactor", "las")
FIFO_POLICIES = ("fifo", "fifo-backfill")


def decay_usage(prev: float, elapsed_s: float, half_life_s: float) -> float:
    """Usage remembered after `elapsed_s`: halves every `half_life_s`."""
    if half_life_s <= 0:
        return 0.0
    if elapsed_s <= 0:
        return prev
    return prev * math.pow(0.5, elapsed_s / half_life_s)


def fairshare_factors(projects: dict[str, ProjectQuota], usage: dict[str, float]) -> dict[str, float]:
    """Slurm's classic fair-share factor 2^(-usage_norm / share_norm): 1 for an
    unused project, 0.5 for one that used exactly its share, towards 0 beyond."""
    total_share = sum(max(p.weight, 0.0) for p in projects.values())
    total_usage = sum(max(u, 0.0) for u in usage.values())
    out: dict[str, float] = {}
    for name in set(projects) | set(usage):
        u = max(usage.get(name, 0.0), 0.0)
        p = projects.get(name)
        share = max(p.weight, 0.0) if p else 0.0
        if total_usage <= 0 or u <= 0:
            out[name] = 1.0
        elif share <= 0 or total_share <= 0:
            out[name] = 0.0
        else:
            out[name] = math.pow(2.0, -(u / total_usage) / (share / total_share))
    return out


def las_queue(attained_gpu_s: float, cfg: Config) -> int:
    """0 for the least served; one more for each threshold the job's service has reached."""
    return bisect.bisect_right(cfg.las_thresholds_gpu_s, attained_gpu_s)


def las_queue_waiting(job: Job, now: float, cfg: Config) -> int:
    """A queued job's LAS queue, after the starvation guard: one that has run before and has
    waited longer than `las_starvation_factor` x its time run is promoted to queue 0."""
    att = job.attained_gpu_s
    if att > 0 and job.gpus > 0:
        waited = now - (job.queued_since if job.queued_since is not None else job.submit_time)
        if waited >= cfg.las_starvation_factor * att / job.gpus:
            return 0
    return las_queue(att, cfg)


def las_queue_running(a: Allocation, now: float, cfg: Config) -> int:
    """A running job's LAS queue: its earlier attempts' service plus this one's so far."""
    return las_queue(a.job.attained_gpu_s + max(a.job.gpus, 0.0) * max(now - a.start_time, 0.0), cfg)


def size_factor(job: Job, cfg: Config) -> float:
    """1 for a tiny job, 0.5 at `size_scale_gpu_s` GPU-seconds asked for, -> 0."""
    gpu_s = max(job.gpus, 0.0) * max(job.time_limit, 0.0)
    return 1.0 / (1.0 + gpu_s / cfg.size_scale_gpu_s)


def _sorted(jobs: list[Job], policy: str, snap: Snapshot) -> list[Job]:
    cfg = snap.config
    if policy in FIFO_POLICIES:
        return sorted(jobs, key=lambda j: (j.submit_time, j.id))
    if policy == "las":
        now = snap.now
        if cfg.las_fair_share:
            # Within a queue, the project furthest below its fair share first (Slurm's factor), then FIFO.
            fs = fairshare_factors(snap.projects, snap.usage)
            return sorted(jobs, key=lambda j: (las_queue_waiting(j, now, cfg), -fs.get(j.project, 1.0),
                                               j.submit_time, j.id))
        return sorted(jobs, key=lambda j: (las_queue_waiting(j, now, cfg), j.submit_time, j.id))
    if policy != "multifactor":
        raise ValueError(f"policy: unknown value {policy!r}; use one of {', '.join(POLICIES)}")
    fs = fairshare_factors(snap.projects, snap.usage)
    max_qos = max((j.qos for j in jobs), default=0)
    wq = cfg.weight_qos / max_qos if max_qos > 0 else 0.0
    wf, wa, ws = cfg.weight_fairshare, cfg.weight_age, cfg.weight_size
    now, max_age, scale = snap.now, cfg.max_age_s, cfg.size_scale_gpu_s

    # One decorated list instead of a key function: this runs over the whole
    # queue every pass, and a call per job costs more than the arithmetic.
    # Age is clamped to 0..1 by min/max written out as conditionals.
    fsf = [fs.get(j.project, 1.0) for j in jobs]
    dec = [(-(wq * j.qos + wf * f
              + wa * (0.0 if j.submit_time > now else min(1.0, (now - j.submit_time) / max_age))
              + ws / (1.0 + (j.gpus if j.gpus > 0 else 0.0) * j.time_limit / scale)),
            j.submit_time, j.id, j) for j, f in zip(jobs, fsf)]
    dec.sort()  # job ids are unique, so the Job itself is never compared
    return [d[3] for d in dec]


def order_queue(snap: Snapshot) -> list[Job]:
    """Jobs in the order the pass considers them. With per-pool policies each
    pool's jobs are sorted by their own policy and the lists are interleaved by
    relative rank, since priorities of different policies do not compare."""
    cfg = snap.config
    if not cfg.pool_policy:
        return _sorted(snap.queued, cfg.policy, snap)
    groups: dict[str, list[Job]] = {}
    for j in snap.queued:
        pol = cfg.pool_policy.get(j.pool, cfg.policy) if j.pool else cfg.policy
        groups.setdefault(pol, []).append(j)
    if len(groups) == 1:
        (pol, jobs), = groups.items()
        return _sorted(jobs, pol, snap)
    ranked = []
    for pol, jobs in groups.items():
        ordered = _sorted(jobs, pol, snap)
        n = len(ordered)
        ranked += [((i + 0.5) / n, j.submit_time, j.id, j) for i, j in enumerate(ordered)]
    ranked.sort(key=lambda r: r[:3])
    return [r[3] for r in ranked]
