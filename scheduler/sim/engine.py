"""Trace replay with a virtual clock through the same `schedule()` as production.

A pass runs at every instant something happens (all submissions and ends at
the same second are batched into one pass). Jobs run for their trace duration,
killed at their walltime if longer. A preempted job goes back to the queue,
keeping its submit time, so its lost work shows in its JCT. A job that does not
checkpoint restarts from zero. A job checkpoints as its spec's `checkpoint` says
(docs/jobs.md; the trace's `checkpoint_grace_s` and `checkpoint_interval_s`
columns), or, with the replay's `checkpoint_interval_s`, every job that names
none does: it saves every `interval_s` of its run (none or 0: only when signalled)
and, preempted, resumes from its last checkpoint; the work lost is the time since
that checkpoint plus the grace it was given to save, which is counted as lost GPU-time
(its GPUs go to the preemptor at once, as in production, where the portal frees
them at the preemption and the next launch waits for the old sandbox). Preemption takes effect at once (grace period 0)
and another pass follows straight away so the preemptor starts. A job's
attained GPU-service (GPUs x time run, over its attempts) and when it last
entered the queue travel with it, for `las`; passes run at submissions and
ends, and under `las` also when a running job crosses a threshold, a waiting
one reaches its promotion time and at the plan's `next_pass_at` (a save that a
preemption waits for), as production's periodic pass would see them.

Jobs may name datasets (`TraceJob.datasets`, given by `datasets.assign_datasets`); with a
`DataModel` a job starting on nodes that lack them first stages them (bytes / the node's
bandwidth, through a per-node LRU cache) while it holds its GPUs, and the core sees the caches
for its locality bonus and capped wait (scheduler/sim/datasets.py). Without one, as before.

A trace gives only a job's GPU count. A job never spans nodes unless it asks
(`Job.nodes`), so one larger than the biggest node of the cluster is replayed as
a multi-node job: nodes = ceil(gpus / biggest node), gpus_per_node = gpus / nodes
when that divides; when it does not, the job is skipped and counted
(`unsplittable`), since no user could have asked for it with equal GPUs per node.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from scheduler.core import Allocation, Config, Job, Node, ProjectQuota, Snapshot, Topology, schedule

from .datasets import DataModel
from .trace import ALIBABA_QOS, TraceJob


@dataclass
class JobRecord:
    trace: TraceJob
    first_start: float | None = None
    end: float | None = None
    preempted: int = 0
    queued_at: float | None = None  # when it last entered the queue (submit, or its preemption)
    wait_s: float = 0.0  # time queued over all its attempts
    lost_gpu_s: float = 0.0  # GPU-seconds its preempted attempts ran and lost (since their last checkpoint)
    progress_s: float = 0.0  # seconds of its run saved in checkpoints: its next attempt resumes there


@dataclass
class SimResult:
    records: dict[str, JobRecord]
    capacity: float  # GPUs in the cluster
    window: tuple[float, float]  # submission window
    alloc_gpu_s: float = 0.0  # allocated GPU-seconds inside the window
    frag_gpu_s: float = 0.0  # idle GPU-seconds inside the window while a job waited
    tenant_alloc_gpu_s: dict[str, float] = field(default_factory=dict)
    tenant_frag_gpu_s: dict[str, float] = field(default_factory=dict)
    preemptions: int = 0
    lost_gpu_s: float = 0.0  # GPU-seconds of work thrown away by preemption (all of the replay)
    passes: int = 0
    skipped: int = 0  # passes skipped because they could not change anything
    dropped: list[str] = field(default_factory=list)  # never fit this cluster
    unsplittable: list[str] = field(default_factory=list)  # above a node, GPUs not divisible by its node count
    multi_node: int = 0  # jobs replayed on several nodes
    frag_jobs: set[str] = field(default_factory=set)  # jobs that ever waited fragmented
    frag_wait_s: float = 0.0  # job-seconds spent waiting fragmented (all of the replay)
    frag_idle_gpu_s: float = 0.0  # idle GPU-seconds inside the window while a fragmented job waited
    guarantees: dict[str, float] = field(default_factory=dict)
    data: DataModel | None = None  # transfers and caches, when jobs name datasets


def to_core_job(t: TraceJob, qos_map: dict[str, int] | None, nodes: int = 1,
                checkpoint_grace_s: float | None = None, checkpoint_interval_s: float | None = None) -> Job:
    qos = qos_map.get(t.tenant, 0) if qos_map else 0
    preemptible = bool(qos_map) and qos == 0
    return Job(t.id, t.tenant, t.tenant, t.tenant, t.gpus, t.submit,
               t.walltime if math.isfinite(t.walltime) else 90 * 86400.0,
               gpu_type=t.gpu_type, qos=qos, preemptible=preemptible, nodes=nodes,
               checkpoint_grace_s=checkpoint_grace_s,
               checkpoint_interval_s=checkpoint_interval_s if checkpoint_grace_s is not None else None)


def saved_on_preemption(ran_s: float, interval_s: float) -> float:
    """Seconds of a preempted attempt's run its checkpoints kept: up to its last checkpoint (every
    `interval_s` of its run; 0: it saves when signalled, so all of it)."""
    if interval_s <= 0:
        return ran_s
    return math.floor(ran_s / interval_s + 1e-9) * interval_s


def nodes_for(gpus: float, node_sizes: list[int]) -> int | None:
    """How many nodes a trace job spans on a cluster with these node sizes (largest
    first): 1 when it fits on a node; else ceil(gpus / largest), if the GPUs divide
    evenly and enough nodes are that large; None when it cannot be asked for."""
    biggest = node_sizes[0] if node_sizes else 0
    if gpus <= biggest:
        return 1
    nodes = math.ceil(gpus / biggest) if biggest else 0
    if not nodes or gpus % nodes:
        return None
    return nodes


class Simulator:
    def __init__(self, jobs: list[TraceJob], nodes: list[Node], projects: dict[str, ProjectQuota],
                 config: Config, alibaba_qos: bool = False, checkpoint_interval_s: float | None = None,
                 checkpoint_grace_s: float = 0.0, data: DataModel | None = None):
        self.nodes = nodes
        self.data = data
        # None: only the jobs whose trace row says so checkpoint; else every job does, as the module says.
        self.checkpoint_interval_s = checkpoint_interval_s
        self.checkpoint_grace_s = checkpoint_grace_s
        self.projects = projects
        self.config = config
        self.qos_map = ALIBABA_QOS if alibaba_qos else None
        self.capacity = float(sum(len(n.gpus) for n in nodes))
        sizes = sorted((len(n.gpus) for n in nodes), reverse=True)
        biggest = sizes[0] if sizes else 0
        models = {g.model for n in nodes for g in n.gpus}
        fits, dropped, unsplittable = [], [], []
        self.span: dict[str, int] = {}  # job id -> nodes, for multi-node jobs
        for t in jobs:
            too_big = t.gpus > self.capacity or (0 < t.gpus < 1 and biggest == 0)
            if too_big or (t.gpu_type and t.gpu_type not in models):
                dropped.append(t.id)
                continue
            k = nodes_for(t.gpus, sizes)
            if k is None:
                unsplittable.append(t.id)
            elif k > 1 and (len(sizes) < k or sizes[k - 1] < t.gpus // k):
                dropped.append(t.id)
            else:
                fits.append(t)
                if k > 1:
                    self.span[t.id] = k
        self.jobs = sorted(fits, key=lambda t: (t.submit, t.id))
        window = (self.jobs[0].submit, self.jobs[-1].submit) if self.jobs else (0.0, 0.0)
        self.res = SimResult({t.id: JobRecord(t) for t in self.jobs}, self.capacity, window,
                             dropped=dropped, guarantees={p: q.guaranteed_gpus for p, q in projects.items()},
                             unsplittable=unsplittable, multi_node=len(self.span), data=data)

    def checkpoint_of(self, t: TraceJob) -> tuple[float, float] | None:
        """(grace, interval) of a job that checkpoints (interval 0: it saves only when signalled),
        from its own spec, else the replay's; None: it restarts from zero when preempted."""
        if t.checkpoint_grace_s is not None:
            return t.checkpoint_grace_s, t.checkpoint_interval_s or 0.0
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_grace_s, self.checkpoint_interval_s
        return None

    def run(self) -> SimResult:
        res, cfg, data = self.res, self.config, self.data
        local = data is not None and data.spec.locality  # the core sees datasets and caches
        trace = {t.id: t for t in self.jobs}
        topo = Topology.from_nodes(self.nodes)  # nodes never change during a replay
        queue: dict[str, Job] = {}
        running: dict[str, Allocation] = {}
        ends: list[tuple[float, int, str]] = []  # (end time, attempt, job id)
        attempt: dict[str, int] = {}
        usage: dict[str, float] = {}
        run_gpus: dict[str, float] = {}  # per tenant, for usage and utilization
        wait_count: dict[str, int] = {}  # per tenant, queued jobs asking for GPUs
        allocated = 0.0
        fragmented: set[str] = set()  # queued jobs the last pass found fragmented
        victimable = 0  # running jobs that are borrowed or preemptible
        hl = cfg.fairshare_half_life_s
        las = cfg.policy == "las" or "las" in cfg.pool_policy.values()  # any running job may be a victim
        w0, w1 = res.window
        now = self.jobs[0].submit if self.jobs else 0.0
        i, n = 0, len(self.jobs)
        wakes: list[float] = []  # las: instants a job's queue changes (a threshold, a promotion)
        while i < n or ends:
            t_next = min(self.jobs[i].submit if i < n else math.inf, ends[0][0] if ends else math.inf,
                         wakes[0] if wakes else math.inf)
            dt = t_next - now
            if dt > 0:
                # Integrate over [now, t_next): nothing changes in between.
                lo, hi = max(now, w0), min(t_next, w1)
                if hi > lo:
                    span = hi - lo
                    res.alloc_gpu_s += allocated * span
                    for p, g in run_gpus.items():
                        if g:
                            res.tenant_alloc_gpu_s[p] = res.tenant_alloc_gpu_s.get(p, 0.0) + g * span
                    if any(wait_count.values()):
                        idle = (self.capacity - allocated) * span
                        res.frag_gpu_s += idle
                        if fragmented:
                            res.frag_idle_gpu_s += idle
                        for p, c in wait_count.items():
                            if c:
                                res.tenant_frag_gpu_s[p] = res.tenant_frag_gpu_s.get(p, 0.0) + idle
                res.frag_wait_s += len(fragmented) * dt
                # Decayed usage: exact integral of g * 2^(-(t_next - s)/hl) ds.
                keep = math.pow(0.5, dt / hl)
                gain = hl / math.log(2) * (1.0 - keep)
                for p in sorted(set(usage) | set(run_gpus)):  # sorted: same float sums every run
                    usage[p] = usage.get(p, 0.0) * keep + run_gpus.get(p, 0.0) * gain
                now = t_next
            changed = False  # did anything happen that could let a queued job start?
            while wakes and wakes[0] <= now:
                heapq.heappop(wakes)
                changed = changed or bool(queue)  # production's next pass (every few seconds) would see it
            while ends and ends[0][0] <= now:
                _, att, jid = heapq.heappop(ends)
                if attempt.get(jid) != att or jid not in running:
                    continue  # a stale end of a preempted attempt
                a = running.pop(jid)
                if data is not None:
                    data.release(jid)
                allocated -= a.job.gpus
                run_gpus[a.job.project] -= a.job.gpus
                victimable -= a.borrowed or a.job.preemptible
                res.records[jid].end = now
                changed = True
            while i < n and self.jobs[i].submit <= now:
                t = self.jobs[i]
                ck = self.checkpoint_of(t)
                queue[t.id] = to_core_job(t, self.qos_map, self.span.get(t.id, 1),
                                          ck and ck[0], (ck and ck[1]) or None)
                if local and t.datasets:
                    queue[t.id].datasets = t.datasets
                if t.gpus > 0:
                    wait_count[t.tenant] = wait_count.get(t.tenant, 0) + 1
                i += 1
                # A new job can start only on free capacity, by preempting, or
                # at once when it needs no GPU; with none of these the pass
                # would return an empty plan, so it is skipped (same outcome).
                changed = changed or t.gpus <= 0 or allocated < self.capacity - 1e-9 \
                    or (cfg.preemption and (victimable > 0 or (las and bool(running))))
            for _ in range(100):  # a pass, and again at once after preemptions
                if not queue or not changed:
                    res.skipped += not changed
                    break
                if local:
                    data.publish(now)
                snap = Snapshot(now, self.nodes, list(running.values()), list(queue.values()),
                                self.projects, {}, usage, cfg)
                plan = schedule(snap, topo)
                res.passes += 1
                fragmented = set(plan.fragmented)
                if plan.next_pass_at is not None and plan.next_pass_at > now:
                    # las passed over a checkpointing job until its next save: a pass then, as
                    # production's periodic pass would run
                    heapq.heappush(wakes, plan.next_pass_at)
                res.frag_jobs |= fragmented
                if data is not None:
                    for until in plan.locality_waits.values():  # a pass when a job's wait for its data ends
                        heapq.heappush(wakes, until)
                    data.prefetch(plan.prefetch, now)
                for s in plan.starts:
                    job = queue.pop(s.job_id)
                    rec = res.records[job.id]
                    if rec.first_start is None:
                        rec.first_start = now
                    rec.wait_s += now - (rec.queued_at if rec.queued_at is not None else rec.trace.submit)
                    running[job.id] = Allocation(job, s.gpu_ids, now, s.fractions, s.borrowed, s.node)
                    allocated += job.gpus
                    victimable += s.borrowed or job.preemptible
                    run_gpus[job.project] = run_gpus.get(job.project, 0.0) + job.gpus
                    if job.gpus > 0:
                        wait_count[job.project] -= 1
                    att = attempt[job.id] = attempt.get(job.id, 0) + 1
                    stage = data.stage(running[job.id], trace[job.id].datasets, now) if data is not None else 0.0
                    heapq.heappush(ends, (now + stage + trace[job.id].runtime - rec.progress_s, att, job.id))
                    if las and job.gpus > 0:  # when it passes its next threshold
                        nxt = [x for x in cfg.las_thresholds_gpu_s if x > job.attained_gpu_s]
                        if nxt:
                            heapq.heappush(wakes, now + (nxt[0] - job.attained_gpu_s) / job.gpus)
                for p in plan.preemptions:
                    a = running.pop(p.job_id, None)
                    if a is None:
                        continue
                    if data is not None:
                        data.release(a.job.id)
                    allocated -= a.job.gpus
                    run_gpus[a.job.project] -= a.job.gpus
                    victimable -= a.borrowed or a.job.preemptible
                    # Its service so far counts for las (across attempts), and it waits anew.
                    a.job.attained_gpu_s += max(a.job.gpus, 0.0) * (now - a.start_time)
                    a.job.queued_since = now
                    queue[a.job.id] = a.job
                    if las and a.job.gpus > 0:  # when the starvation guard promotes it
                        heapq.heappush(wakes, now + cfg.las_starvation_factor * a.job.attained_gpu_s / a.job.gpus)
                    if a.job.gpus > 0:
                        wait_count[a.job.project] = wait_count.get(a.job.project, 0) + 1
                    rec = res.records[a.job.id]
                    rec.preempted += 1
                    rec.queued_at = now
                    ran = now - a.start_time
                    ck = self.checkpoint_of(rec.trace)
                    if ck is not None:
                        kept = saved_on_preemption(ran, ck[1])
                        rec.progress_s += kept
                        ran = ran - kept + ck[0]
                    lost = max(a.job.gpus, 0.0) * ran
                    rec.lost_gpu_s += lost
                    res.lost_gpu_s += lost
                    res.preemptions += 1
                if not plan.preemptions:
                    break
        return res


def make_projects(tenants: list[str], capacity: float, quota_nodes: dict[str, int] | None,
                  gpus_per_quota_node: int = 8) -> dict[str, ProjectQuota]:
    """Each tenant a project (and an org). With a quota file: guaranteed GPUs =
    its nodes x 8, scaled to this cluster's size; without: equal shares. Every
    tenant may borrow up to the whole cluster."""
    if quota_nodes:
        total = sum(quota_nodes.values()) * gpus_per_quota_node
        guar = {t: quota_nodes.get(t, 0) * gpus_per_quota_node * capacity / total for t in tenants}
    else:
        guar = {t: capacity / max(len(tenants), 1) for t in tenants}
    return {t: ProjectQuota(t, t, guaranteed_gpus=guar[t], max_gpus=capacity) for t in tenants}
