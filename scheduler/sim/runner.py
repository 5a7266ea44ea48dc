"""One replay as the CLI and bench/replay.py run it: the shared cluster, then
each tenant alone on a cluster the size of its guarantee (for fairness)."""
from __future__ import annotations

import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from scheduler.core import Config, ProjectQuota

from .datasets import DataModel, DataSpec, assign_datasets
from .engine import Simulator, make_projects
from .metrics import isolated_gpus, summarize
from .trace import TraceJob, read_nodes, read_quota, read_trace, sample_nodes, uniform_nodes


@dataclass
class ReplaySpec:
    trace: str
    start_day: float | None = None
    days: float | None = None
    gpus: int = 384
    gpus_per_node: int = 8
    policy: str = "multifactor"
    backfill: bool = True
    preemption: bool = True
    quotas: bool = True
    explain: bool = True  # as production; False decides the same (tests/scheduler/test_explain.py), faster
    las_thresholds_gpu_s: tuple[float, ...] = Config.las_thresholds_gpu_s
    las_starvation_factor: float = Config.las_starvation_factor
    placement: str = "bestfit"
    quota: str | None = None
    nodes: str | None = None
    load_scale: float = 1.0
    fairness: bool = True
    workers: int = 1
    # Every job checkpoints every this many seconds of its run (0: when signalled) and gets this grace
    # to save when preempted; None: no job checkpoints, a preempted one restarts from zero.
    checkpoint_interval_s: float | None = None
    checkpoint_grace_s: float = 0.0
    # Datasets (scheduler/sim/datasets.py): with `data.count` > 0 jobs read datasets of a Zipf
    # popularity and nodes stage and cache them; `locality_wait_s` is the core's capped wait.
    data: DataSpec | None = None
    locality_wait_s: float = Config.locality_wait_s
    prefetch_horizon_s: float = Config.prefetch_horizon_s


def _config(spec: ReplaySpec) -> Config:
    # Production's Config: the same caps and, by default, the same mode (reasons are written and
    # thrown away). Explaining never changes a decision, so --no-explain only saves time.
    return Config(policy=spec.policy, backfill=spec.backfill, preemption=spec.preemption, quotas=spec.quotas,
                  placement=spec.placement, explain=spec.explain, las_thresholds_gpu_s=tuple(spec.las_thresholds_gpu_s),
                  las_starvation_factor=spec.las_starvation_factor, locality_wait_s=spec.locality_wait_s,
                  prefetch_horizon_s=spec.prefetch_horizon_s)


def _checkpoints(spec: ReplaySpec) -> dict:
    return {"checkpoint_interval_s": spec.checkpoint_interval_s, "checkpoint_grace_s": spec.checkpoint_grace_s}


def _data(spec: ReplaySpec, nodes) -> dict:
    """The Simulator's `data` argument: a fresh model of these nodes' caches, or none."""
    return {"data": DataModel(nodes, spec.data)} if spec.data is not None and spec.data.count > 0 else {}


def _cluster(spec: ReplaySpec):
    if spec.nodes:
        return read_nodes(spec.nodes)
    return uniform_nodes(spec.gpus, spec.gpus_per_node)


def _isolated(args) -> tuple[str, float | None]:
    """Mean JCT of one tenant's jobs alone on a cluster of `isolated_gpus` (its guarantee or an equal share)."""
    spec, tenant, guar, jobs = args
    biggest = max((j.gpus for j in jobs), default=1.0)
    size = max(1, round(guar), math.ceil(biggest))
    if spec.nodes:
        nodes = sample_nodes(read_nodes(spec.nodes), size, int(max(biggest, 1)))
    else:
        nodes = uniform_nodes(size, spec.gpus_per_node, prefix=f"{tenant}-")
    cap = float(sum(len(n.gpus) for n in nodes))
    projects = {tenant: ProjectQuota(tenant, tenant, guaranteed_gpus=cap, max_gpus=cap)}
    res = Simulator(jobs, nodes, projects, _config(spec), alibaba_qos=bool(spec.nodes),
                    **_checkpoints(spec), **_data(spec, nodes)).run()
    done = [r.end - r.trace.submit for r in res.records.values() if r.end is not None]
    return tenant, (sum(done) / len(done) if done else None)


def replay(spec: ReplaySpec) -> dict:
    t0 = time.perf_counter()
    jobs = read_trace(spec.trace, spec.start_day, spec.days, spec.load_scale)
    if spec.data is not None:
        assign_datasets(jobs, spec.data)
    nodes = _cluster(spec)
    capacity = float(sum(len(n.gpus) for n in nodes))
    tenants = sorted({j.tenant for j in jobs})
    quota = read_quota(spec.quota) if spec.quota else None
    projects = make_projects(tenants, capacity, quota)
    sim = Simulator([TraceJob(**vars(j)) for j in jobs], nodes, projects, _config(spec),
                    alibaba_qos=bool(spec.nodes), **_checkpoints(spec), **_data(spec, nodes))
    res = sim.run()
    shared_s = time.perf_counter() - t0
    iso = {}
    if spec.fairness:
        work = [(spec, t, isolated_gpus(projects[t].guaranteed_gpus, capacity, len(tenants)),
                 [TraceJob(**vars(j)) for j in jobs if j.tenant == t])
                for t in tenants]
        if spec.workers > 1 and len(work) > 1:
            with ProcessPoolExecutor(spec.workers) as ex:
                iso = dict(ex.map(_isolated, work))
        else:
            iso = dict(map(_isolated, work))
    out = summarize(res, {t: v for t, v in iso.items() if v})
    out["gpus"] = capacity
    out["policy"] = spec.policy
    out["backfill"] = spec.backfill
    out["wall_s_shared"] = shared_s
    out["wall_s"] = time.perf_counter() - t0
    return out
