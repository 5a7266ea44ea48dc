"""Datasets in the trace simulator: which jobs read what, node caches and transfer time.

Trace jobs name no datasets; `assign_datasets` gives them some, from a catalogue whose
popularity follows a Zipf law (seeded, so a replay is repeatable). `DataModel` keeps, per node,
an LRU cache of a set capacity (datasets used by a running job on the node are pinned, as the
agent's reference counts pin them) and a link of a set bandwidth: a job starting on a node that
lacks some of its datasets first stages them, bytes / bandwidth, one transfer after another on
that node's link, while it holds its GPUs; its run begins when the last has arrived (for a gang,
on the slowest of its nodes). A dataset that does not fit in the cache beside the pinned ones is
staged for the job and not kept.

With `locality` the core sees each node's complete cache entries (`Node.datasets`) and each
job's datasets (`Job.datasets`), so it prefers nodes holding them and may wait for one
(`Config.locality_wait_s`); with `prefetch` a node starts fetching what a job the plan reserved
it for lacks (`Plan.prefetch`). Without `locality` the core sees neither, exactly as a replay of
a trace without datasets, and only the transfers are modelled.
"""
from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler.core import Allocation, Dataset, Node

GB = 10**9


@dataclass
class DataSpec:
    """The data side of a replay (the CLI's and ReplaySpec's dataset options)."""

    count: int = 0  # datasets in the catalogue; 0: jobs name none (a plain replay)
    zipf_s: float = 1.1  # popularity of the dataset of rank r is proportional to 1 / r^s
    seed: int = 0
    min_gb: float = 1.0  # sizes are log-uniform between these
    max_gb: float = 1000.0
    share: float = 1.0  # the part of GPU jobs that read a dataset
    bandwidth_gbps: float = 10.0  # each node's link, Gbit/s
    cache_gb: float = 2000.0  # each node's cache
    locality: bool = True  # the core sees caches and datasets (bonus, capped wait)
    prefetch: bool = True  # reserved nodes fetch ahead (needs locality)


def catalogue(spec: DataSpec) -> list[Dataset]:
    """`spec.count` datasets, most popular first, with log-uniform sizes (seeded)."""
    rnd = random.Random(f"sizes-{spec.seed}")
    lo, hi = math.log(spec.min_gb), math.log(spec.max_gb)
    out = []
    for i in range(spec.count):
        name = f"ds{i:03d}"
        out.append(Dataset(hashlib.sha256(name.encode()).hexdigest(), int(math.exp(rnd.uniform(lo, hi)) * GB),
                           f"{name}@1"))
    return out


def assign_datasets(jobs: list, spec: DataSpec) -> list[Dataset]:
    """Give `spec.share` of the GPU jobs (trace jobs, in place) one dataset each, drawn by Zipf
    popularity; returns the catalogue. Seeded: the same trace and spec give the same datasets."""
    cat = catalogue(spec)
    if not cat:
        return cat
    rnd = random.Random(f"jobs-{spec.seed}")
    weights = [1.0 / (r + 1) ** spec.zipf_s for r in range(len(cat))]
    for j in jobs:
        pick = rnd.choices(cat, weights)[0]  # drawn for every job, so `share` keeps the others' picks
        if j.gpus > 0 and rnd.random() < spec.share:
            j.datasets = (pick,)
    return cat


@dataclass
class NodeCache:
    entries: OrderedDict = field(default_factory=OrderedDict)  # digest -> [size, ready_at, prefetched], LRU first
    used: int = 0
    pins: dict[str, int] = field(default_factory=dict)
    link_free: float = -math.inf  # when the transfers queued on its link are done


class DataModel:
    def __init__(self, nodes: list[Node], spec: DataSpec):
        self.spec = spec
        self.nodes = nodes
        self.node_of = {g.id: n.name for n in nodes for g in n.gpus}
        self.caches = {n.name: NodeCache() for n in nodes}
        self.rate = spec.bandwidth_gbps * 1e9 / 8  # bytes per second
        self.capacity = spec.cache_gb * GB
        self.pinned: dict[str, list[tuple[str, str]]] = {}  # job id -> (node, digest) it pins
        # Figures: bytes over the nodes' links (prefetch included), starts of jobs naming datasets,
        # of them those that found all their data on their nodes, seconds spent staging at starts.
        self.bytes_moved = 0
        self.bytes_prefetched = 0
        self.bytes_prefetch_used = 0
        self.starts = 0
        self.local_starts = 0
        self.staging_s = 0.0

    def publish(self, now: float) -> None:
        """What the core sees: each node's complete entries (a transfer in flight is not yet)."""
        if not self.spec.locality:
            return
        for n in self.nodes:
            n.datasets = {d for d, e in self.caches[n.name].entries.items() if e[1] <= now}

    def _fetch(self, c: NodeCache, d: Dataset, now: float, prefetch: bool = False) -> float:
        """Queue `d` on the node's link; keep it in the cache when it fits. When it has arrived."""
        start = max(now, c.link_free)
        c.link_free = start + d.size / self.rate
        self.bytes_moved += d.size
        if d.size <= self.capacity:
            for digest in list(c.entries):
                if c.used + d.size <= self.capacity:
                    break
                if not c.pins.get(digest):
                    c.used -= c.entries.pop(digest)[0]
            if c.used + d.size <= self.capacity:
                c.entries[d.digest] = [d.size, c.link_free, prefetch]
                c.used += d.size
        return c.link_free

    def stage(self, alloc: Allocation, datasets: tuple[Dataset, ...], now: float) -> float:
        """Seconds before a starting job can run: until its nodes hold its datasets. Pins them."""
        if not datasets:
            return 0.0
        nodes = [alloc.node] if alloc.node else list(dict.fromkeys(self.node_of[g] for g in alloc.gpu_ids))
        ready, pins = now, []
        for node in nodes:
            c = self.caches[node]
            for d in {d.digest: d for d in datasets}.values():
                e = c.entries.get(d.digest)
                if e is None:
                    ready = max(ready, self._fetch(c, d, now))
                else:
                    c.entries.move_to_end(d.digest)
                    ready = max(ready, e[1])
                    if e[2]:  # a prefetch that served a start
                        self.bytes_prefetch_used += e[0]
                        e[2] = False
                if d.digest in c.entries:
                    c.pins[d.digest] = c.pins.get(d.digest, 0) + 1
                    pins.append((node, d.digest))
        self.pinned[alloc.job.id] = pins
        self.starts += 1
        self.local_starts += ready <= now
        self.staging_s += ready - now
        return ready - now

    def release(self, job_id: str) -> None:
        """A job ended or was preempted: its datasets are evictable again on its nodes."""
        for node, digest in self.pinned.pop(job_id, ()):
            c = self.caches[node]
            c.pins[digest] -= 1

    def prefetch(self, plan_prefetch: dict[str, list[Dataset]], now: float) -> None:
        if not (self.spec.locality and self.spec.prefetch):
            return
        for node, datasets in plan_prefetch.items():
            c = self.caches[node]
            for d in datasets:
                if d.digest not in c.entries:
                    self.bytes_prefetched += d.size
                    self._fetch(c, d, now, prefetch=True)

    def summary(self) -> dict:
        return {
            "data_bytes_moved": self.bytes_moved,
            "data_bytes_prefetched": self.bytes_prefetched,
            "data_bytes_prefetch_used": self.bytes_prefetch_used,
            "data_starts": self.starts,
            "data_local_starts": self.local_starts,
            "data_staging_mean_s": self.staging_s / self.starts if self.starts else 0.0,
        }
