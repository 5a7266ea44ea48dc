"""The metrics of docs/design.md section 9, defined once for the sim and the benches."""
from __future__ import annotations

import math

from .engine import SimResult

TAU_S = 10.0  # bounded-slowdown threshold: jobs shorter than this count as this long


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def _job_metrics(recs) -> dict:
    done = [r for r in recs if r.end is not None]
    if not done:
        return {"jobs": 0, "jct_mean": None, "jct_p50": None, "jct_p95": None, "jct_p99": None,
                "wait_mean": None, "first_wait_mean": None, "bounded_slowdown_mean": None, "preemptions": 0,
                "lost_gpu_hours": 0.0}
    jct = [r.end - r.trace.submit for r in done]
    # Every wait counts: a preempted job waits again, and that wait is part of its JCT too.
    wait = [r.wait_s for r in done]
    first = [r.first_start - r.trace.submit for r in done]
    bsld = [max(1.0, (r.end - r.trace.submit) / max(r.trace.runtime, TAU_S)) for r in done]
    return {
        "jobs": len(done),
        "jct_mean": sum(jct) / len(jct),
        "jct_p50": percentile(jct, 50),
        "jct_p95": percentile(jct, 95),
        "jct_p99": percentile(jct, 99),
        "wait_mean": sum(wait) / len(wait),
        "first_wait_mean": sum(first) / len(first),
        "bounded_slowdown_mean": sum(bsld) / len(bsld),
        "preemptions": sum(r.preempted for r in recs),
        "lost_gpu_hours": sum(r.lost_gpu_s for r in recs) / 3600.0,
    }


def isolated_gpus(guaranteed: float, capacity: float, tenants: int) -> float:
    """The cluster a tenant is measured alone on, for fairness: its guarantee, or, for a tenant
    without one, an equal share of the whole cluster (capacity / tenants in the replay), so
    that every tenant counts in fairness_max."""
    return guaranteed if guaranteed > 0 else capacity / max(tenants, 1)


def summarize(res: SimResult, isolated_jct: dict[str, float] | None = None) -> dict:
    """Overall and per-tenant metrics. Utilization is allocated GPU-seconds over
    capacity inside the submission window (per tenant: over its guarantee, so
    above 1 means it borrowed); fragmentation is idle GPU-seconds while some
    job (per tenant: one of its jobs) waited, over capacity in the window.
    Fairness is the tenant's mean JCT here over its mean JCT alone on a cluster
    of `isolated_gpus` (its guarantee, or an equal share without one; None only
    where it has no isolated run). wait_mean counts every wait of a job (each
    attempt's time queued), first_wait_mean only the first. lost_gpu_hours is
    the work preempted attempts ran and lost (all of it when restarting from zero; with checkpoints
    the time since the last one plus the grace to save); lost_capacity
    the same over capacity x the submission window.
    Fragmented waits (enough GPUs free, but not on one node or not on the nodes a
    multi-node job asked for): how many jobs waited so, their mean time waiting so,
    and the part of `fragmentation` that passed while one did."""
    span = max(res.window[1] - res.window[0], 1e-9)
    out = _job_metrics(list(res.records.values()))
    out["preemptions"] = res.preemptions
    out["lost_gpu_hours"] = res.lost_gpu_s / 3600.0
    out["lost_capacity"] = res.lost_gpu_s / (res.capacity * span)
    out["utilization"] = res.alloc_gpu_s / (res.capacity * span)
    out["fragmentation"] = res.frag_gpu_s / (res.capacity * span)
    out["fragmented_jobs"] = len(res.frag_jobs)
    out["fragmented_wait_mean"] = res.frag_wait_s / len(res.frag_jobs) if res.frag_jobs else 0.0
    out["fragmentation_split"] = res.frag_idle_gpu_s / (res.capacity * span)
    by_tenant: dict[str, list] = {}
    for r in res.records.values():
        by_tenant.setdefault(r.trace.tenant, []).append(r)
    tenants = {}
    for t, recs in sorted(by_tenant.items()):
        m = _job_metrics(recs)
        guar = res.guarantees.get(t, 0.0)
        m["utilization"] = res.tenant_alloc_gpu_s.get(t, 0.0) / (guar * span) if guar > 0 else None
        m["fragmentation"] = res.tenant_frag_gpu_s.get(t, 0.0) / (res.capacity * span)
        iso = (isolated_jct or {}).get(t)
        m["fairness"] = m["jct_mean"] / iso if (iso and m["jct_mean"] is not None) else None
        m["fairness_max"] = m["fairness"]
        tenants[t] = m
    fair = [m["fairness"] for m in tenants.values() if m["fairness"] is not None]
    out["fairness_max"] = max(fair) if fair else None
    out["tenants"] = tenants
    out["passes"] = res.passes
    out["passes_skipped"] = res.skipped
    out["dropped"] = len(res.dropped)
    out["unsplittable"] = len(res.unsplittable)
    out["multi_node"] = res.multi_node
    if res.data is not None:  # jobs named datasets: bytes moved, local starts, staging time
        out.update(res.data.summary())
    return out
