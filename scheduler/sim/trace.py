"""Reading traces (docs/design.md section 9) into core jobs, nodes and quotas."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass

from scheduler.core import GPU, Node

DAY = 86400.0

# Alibaba's QoS classes, as the sim maps them onto core QoS levels. Best-effort
# pods are the preemptible kind, as in Kubernetes.
ALIBABA_QOS = {"Guaranteed": 3, "LS": 2, "Burstable": 1, "BE": 0}

# Memory per GPU model in the Alibaba node list (the file has none); only used
# to label GPUs, since the trace's fractions carry no memory request.
MODEL_MEMORY_MB = {"T4": 16384, "P100": 16384, "V100M16": 16384, "V100M32": 32768, "A10": 24576,
                   "G2": 24576, "G3": 32768}


@dataclass
class TraceJob:
    id: str
    submit: float
    duration: float
    gpus: float
    tenant: str
    walltime: float
    gpu_type: str | None = None
    datasets: tuple = ()  # core Datasets it reads (scheduler/sim/datasets.py); traces give none
    # Its spec's `checkpoint` (docs/jobs.md), from the optional trace columns: the grace it gets to
    # save when preempted (None: it does not checkpoint, unless the replay makes every job do so) and
    # how often it saves on its own (`interval_s`; None: only when signalled).
    checkpoint_grace_s: float | None = None
    checkpoint_interval_s: float | None = None

    @property
    def runtime(self) -> float:
        """What it actually runs for: killed at its walltime if longer."""
        return min(self.duration, self.walltime) if self.walltime > 0 else self.duration


def read_trace(path: str, start_day: float | None = None, days: float | None = None,
               load_scale: float = 1.0) -> list[TraceJob]:
    """Jobs submitted in [start_day, start_day + days) days; with load_scale X
    the gaps between submissions are divided by X (X > 1: more load)."""
    lo = start_day * DAY if start_day is not None else -math.inf
    hi = lo + days * DAY if (days is not None and start_day is not None) else math.inf
    out: list[TraceJob] = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            submit = float(row["submit_time"])
            if submit < lo:
                continue
            if submit >= hi:
                break  # the file is sorted by submit_time
            gpus = float(row["gpus"])
            if gpus >= 1:
                gpus = float(math.ceil(gpus - 1e-9))
            out.append(TraceJob(row["job_id"], submit, float(row["duration"]), gpus, row["tenant"],
                                float(row.get("walltime") or 0) or math.inf,
                                (row.get("gpu_type") or None),
                                checkpoint_grace_s=_seconds(row.get("checkpoint_grace_s")),
                                checkpoint_interval_s=_seconds(row.get("checkpoint_interval_s"))))
    if out and load_scale != 1.0:
        t0 = out[0].submit
        for j in out:
            j.submit = t0 + (j.submit - t0) / load_scale
    return out


def _seconds(cell: str | None) -> float | None:
    """An optional column's seconds: None where the trace has no such column or leaves it empty."""
    return float(cell) if cell not in (None, "") else None


def read_quota(path: str) -> dict[str, int]:
    """Tenant -> nodes (of 8 GPUs) from philly_vc_quota.csv."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return {r[0]: int(r[1]) for r in rows[1:] if len(r) >= 2 and r[1].strip()}


def uniform_nodes(n_gpus: int, per_node: int, model: str = "GPU", memory_mb: int = 16384,
                  prefix: str = "n") -> list[Node]:
    """`n_gpus` GPUs in nodes of `per_node`, the last node smaller if need be."""
    nodes = []
    i = 0
    while n_gpus > 0:
        k = min(per_node, n_gpus)
        name = f"{prefix}{i:04d}"
        nodes.append(Node(name, "default", [GPU(f"{name}-{x}", name, x, model, memory_mb) for x in range(k)]))
        n_gpus -= k
        i += 1
    return nodes


def read_nodes(path: str, shared: bool = True) -> list[Node]:
    """Nodes from alibaba_nodes.csv (sn,cpu_milli,memory_mib,gpu,model); their
    GPUs are in shared mode so fractional pods pack."""
    nodes = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            name, model, k = row["sn"], row["model"], int(row["gpu"])
            mem = MODEL_MEMORY_MB.get(model, 16384)
            nodes.append(Node(name, "default",
                              [GPU(f"{name}-{x}", name, x, model, mem, shared=shared) for x in range(k)]))
    return nodes


def sample_nodes(nodes: list[Node], n_gpus: float, min_node_gpus: int) -> list[Node]:
    """About `n_gpus` GPUs' worth of `nodes`, taken at an even stride so the mix
    of models is kept, with at least one node of `min_node_gpus` GPUs."""
    total = sum(len(n.gpus) for n in nodes)
    if n_gpus >= total:
        return list(nodes)
    stride = total / max(n_gpus, 1.0)
    out, acc, got = [], 0.0, 0
    for n in nodes:
        acc += len(n.gpus)
        if acc >= stride and got < n_gpus:
            out.append(n)
            got += len(n.gpus)
            acc -= stride
    if not any(len(n.gpus) >= min_node_gpus for n in out):
        big = next((n for n in nodes if len(n.gpus) >= min_node_gpus), None)
        if big is not None:
            out.append(big)
    return out
