"""Choosing running work to preempt for a job within its guarantee.

A victim must have run at least `min_runtime_s` and be either borrowed (it
started above its project's guarantee, the project is *still* above it, and it
is another project) or marked preemptible with a lower QoS than the job. The
"still above" test stops ping-pong: once a project is back within its
guarantee its remaining jobs are its own, whatever they started as. Among the victims that make the job fit we pick
the fewest, then the cheapest (GPU-seconds of work lost), all on one node for a
single-node job, on exactly as many nodes as a multi-node job asks for.

Checkpointing jobs (`Job.checkpoint_grace_s`) go first: one loses only the grace it gets to save
(its next attempt resumes), one that does not checkpoint loses its whole attempt. A job that does
not checkpoint is taken only as a last resort: where no set of checkpointing victims (with free
GPUs) makes room, and, like every victim, after `min_runtime_s`.

Under `las` a second pool (`queue_of` given) applies Tiresias' rule instead: any running job
past its minimum runtime whose LAS queue is higher (more attained GPU-service) than the
queued job's may be preempted for it, whatever its quota.
"""
from __future__ import annotations

import math

from .admission import EPS, Tally
from .model import Allocation, Config, Job, ProjectQuota
from .placement import UNITS, ClassKey, ClusterState, alloc_units, frac_units


def since_checkpoint(a: Allocation, now: float) -> float:
    """Seconds a checkpointing job's attempt has run since its last own save (0 for one that saves
    when signalled): its saves come every `checkpoint_interval_s` of the attempt's run."""
    every = a.job.checkpoint_interval_s
    if not every:
        return 0.0
    ran = max(now - a.start_time, 0.0)
    return max(ran - math.floor(ran / every + 1e-9) * every, 0.0)


def next_checkpoint(a: Allocation, now: float) -> float:
    """When a job that saves every `checkpoint_interval_s` next saves."""
    every = a.job.checkpoint_interval_s
    return now - since_checkpoint(a, now) + every


def las_candidates(running: list[Allocation], now: float, cfg: Config) -> tuple[list[Allocation], list[Allocation]]:
    """The running jobs the las rule may preempt now, and those it passes over only until their next
    own save. A job that does not checkpoint is kept once its attempt has run past
    `las_max_loss_gpu_s` (all of that would be lost); one that saves every `checkpoint_interval_s`
    is a victim only within `las_checkpoint_window_s` after a save, so it loses little more than its
    grace. The minimum runtime is the pool's own test."""
    bound, window = cfg.las_max_loss_gpu_s, cfg.las_checkpoint_window_s
    now_ok, later = [], []
    for a in running:
        if not a.job.checkpoints:
            if bound is None or max(a.job.gpus, 0.0) * (now - a.start_time) <= bound:
                now_ok.append(a)
        elif a.job.checkpoint_interval_s and since_checkpoint(a, now) > window + EPS:
            later.append(a)
        else:
            now_ok.append(a)
    return now_ok, later


class VictimPool:
    def __init__(self, running: list[Allocation], now: float, min_runtime_s: float, state: ClusterState,
                 tally: Tally, projects: dict[str, ProjectQuota], queue_of: dict[str, int] | None = None,
                 taken: set[str] | None = None):
        self.now = now
        self.queue_of = queue_of  # job id -> LAS queue, running and queued jobs: the las rule
        self.state = state
        self.tally = tally
        self.projects = projects
        self.lost: dict[str, float] = {}  # GPUs per project already chosen as victims
        self.cands = [a for a in running
                      if now - a.start_time >= min_runtime_s
                      and (queue_of is not None or a.borrowed or a.job.preemptible)
                      and any(gid in state.gpu for gid in a.gpu_ids)]
        # Job ids already chosen this pass; shared between the pools of one pass.
        self.taken: set[str] = taken if taken is not None else set()
        self.left = len(self.cands)
        # (class, node) -> candidates with whole GPUs there; gpu -> candidates on a shared GPU
        self.on_node: dict[tuple[ClassKey, str], list[Allocation]] = {}
        self.on_gpu: dict[str, list[Allocation]] = {}
        for a in self.cands:
            for gid in a.gpu_ids:
                if gid not in state.gpu:
                    continue
                if a.fractions or state.gpu[gid].shared:
                    self.on_gpu.setdefault(gid, []).append(a)
                if not a.fractions:
                    key = (state.cls_of[gid], state.gpu[gid].node)
                    lst = self.on_node.setdefault(key, [])
                    if not lst or lst[-1] is not a:
                        lst.append(a)

    def __bool__(self) -> bool:
        # Candidates this pool has not chosen yet (an overestimate when the other pool of the
        # pass chose some of them: that costs a search, never a wrong victim).
        return self.left > 0

    def cost(self, a: Allocation) -> float:
        """GPU-seconds of work lost: a checkpointing job's grace (and, for one that saves on its own
        every `checkpoint_interval_s`, the time since its last save), another's whole attempt so far."""
        ran = max(self.now - a.start_time, 0.0)
        grace = a.job.checkpoint_grace_s
        if grace is None:
            return max(a.job.gpus, 0.01) * ran
        return max(a.job.gpus, 0.01) * (since_checkpoint(a, self.now) + min(ran, grace))

    def eligible(self, a: Allocation, job: Job) -> bool:
        if self.queue_of is not None:
            return self.queue_of[a.job.id] > self.queue_of[job.id]
        if a.job.preemptible and a.job.qos < job.qos:
            return True
        if not a.borrowed or a.job.project == job.project:
            return False
        p = a.job.project
        proj = self.projects.get(p)
        guaranteed = proj.guaranteed_gpus if proj else 0.0
        return self.tally.proj_gpus.get(p, 0.0) - self.lost.get(p, 0.0) > guaranteed + EPS

    def _ok(self, a: Allocation, job: Job) -> bool:
        return a.job.id not in self.taken and self.eligible(a, job)

    def _gpus_in(self, a: Allocation, cls: ClassKey, node: str | None) -> int:
        st = self.state
        return sum(1 for gid in a.gpu_ids if gid in st.gpu and st.cls_of[gid] == cls
                   and gid not in st.held and (node is None or st.gpu[gid].node == node))

    def _cover(self, have: int, need: int, options: list[tuple[Allocation, int]]):
        """Greedy: largest contribution first (fewest victims), then drop the
        costliest ones that turn out unnecessary."""
        options = sorted(options, key=lambda o: (not o[0].job.checkpoints, -o[1], self.cost(o[0])))
        chosen, got = [], have
        for a, n in options:
            if got >= need:
                break
            chosen.append((a, n))
            got += n
        if got < need:
            return None
        for item in sorted(chosen, key=lambda o: -self.cost(o[0])):
            if got - item[1] >= need:
                chosen.remove(item)
                got -= item[1]
        return [a for a, _ in chosen]

    def find(self, job: Job, classes: list[ClassKey]) -> list[Allocation] | None:
        """Victims that would let `job` fit, or None. Marks them taken."""
        best = self._find_fraction(job, classes) if job.gpus < 1 else self._find_whole(job, classes)
        if best:
            self.left -= len(best)
            for a in best:
                self.taken.add(a.job.id)
                self.lost[a.job.project] = self.lost.get(a.job.project, 0.0) + max(a.job.gpus, 0.0)
        return best

    def _score(self, victims):
        # Victims that do not checkpoint first (a last resort), then how many, then work lost.
        return (sum(1 for a in victims if not a.job.checkpoints), len(victims), sum(self.cost(a) for a in victims))

    def _find_whole(self, job: Job, classes: list[ClassKey]):
        """Victims on one node for a single-node job; for a gang of `nodes` nodes, the
        `nodes` nodes (free ones cost nothing) whose victims together are fewest and cheapest."""
        st, per, nodes, wanted = self.state, job.gpus_per_node, job.nodes, set(classes)
        per_node: dict[ClassKey, list] = {}  # cls -> [(score, node, victims)]
        for (cls, node), allocs in self.on_node.items():
            if cls not in wanted or st.node_size[(cls, node)] < per:
                continue
            opts = [(a, self._gpus_in(a, cls, node)) for a in allocs if self._ok(a, job)]
            have = len(st.free[cls][node])
            victims = self._cover(have, per, [o for o in opts if o[1] > 0]) if have < per else None
            if victims:
                per_node.setdefault(cls, []).append((self._score(victims), node, victims))
        best = None
        for cls, found in per_node.items():
            if nodes == 1:
                pick = [min(found, key=lambda f: f[:2])[2]]
            else:
                # Nodes that already have room join the gang at no cost.
                free = [n for k in range(per, len(st.buckets[cls])) for n in st.buckets[cls][k]]
                if len(free) >= nodes:
                    continue  # not for want of victims; placement failed for another reason
                found.sort(key=lambda f: f[:2])
                pick = [f[2] for f in found[:nodes - len(free)]]
                if len(pick) < nodes - len(free):
                    continue
            victims = list({a.job.id: a for vs in pick for a in vs}.values())
            if best is None or self._score(victims) < self._score(best):
                best = victims
        return best

    def _find_fraction(self, job: Job, classes: list[ClassKey]):
        st, wanted = self.state, set(classes)
        best = None
        for gid, allocs in self.on_gpu.items():
            cls = st.cls_of[gid]
            if cls not in wanted or not cls[3] or gid in st.held:
                continue
            need = frac_units(job, cls[2])
            if need > UNITS:
                continue
            opts = [(a, alloc_units(a, st.gpu[gid])) for a in allocs if self._ok(a, job)]
            victims = self._cover(st.free_units(gid), need, opts)
            if victims and (best is None or self._score(victims) < self._score(best)):
                best = victims
        return best
