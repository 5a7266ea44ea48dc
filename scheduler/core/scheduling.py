"""The scheduling pass: snapshot in, plan out. No I/O, no clock, no Django."""
from __future__ import annotations

from .admission import EPS, Tally, admit, fmt_duration, fmt_gpus
from .backfill import Held, could_use, earliest_start, release_timeline, reserve, with_released
from .model import (
    REASON_PREEMPTING, REASON_PRIORITY, REASON_RESERVATION, REASON_RESOURCES, REASON_UNPLACEABLE,
    Allocation, Job, Plan, Preemption, Reason, Snapshot, Start,
)
from .ordering import order_queue
from .placement import UNITS, ClassKey, ClusterState, Topology
from .preempt import VictimPool


class _Pass:
    """State of one pass; `schedule()` is the public entry point."""

    def __init__(self, snap: Snapshot, topology: Topology | None):
        self.snap = snap
        self.cfg = snap.config
        self.now = snap.now
        self.state = ClusterState.build(snap.nodes, snap.running, topology)
        self.tally = Tally.from_running(snap.running)
        self.models = self.state.topo.models
        self.capacity = self.state.topo.capacity
        self.plan = Plan()
        self.codes: dict[str, tuple[str, str]] = {}
        self.started: list[Allocation] = []
        self.helds: list[Held] = []
        self.victims = VictimPool(snap.running, self.now, self.cfg.min_runtime_s, self.state) \
            if self.cfg.preemption else None
        self.preempted: set[str] = set()
        self.preempt_attempts = 0
        self._classes: dict[tuple, list[ClassKey]] = {}

    # -- helpers -----------------------------------------------------------
    def classes_for(self, job: Job) -> list[ClassKey]:
        proj = self.snap.projects.get(job.project)
        allowed = proj.allowed_gpu_types if proj else ()
        frac = 0 < job.gpus < 1
        key = (job.pool, job.gpu_type, job.gpu_memory_mb, allowed, frac)
        out = self._classes.get(key)
        if out is None:
            out = [c for c in self.state.classes
                   if (job.pool is None or c[0] == job.pool)
                   and (c[1] == job.gpu_type if job.gpu_type is not None else (not allowed or c[1] in allowed))
                   and (frac or c[2] >= job.gpu_memory_mb)
                   and (c[3] or not frac)]
            self._classes[key] = out
        return out

    def mode_for(self, job: Job, classes: list[ClassKey]) -> str:
        pool = job.pool if job.pool is not None else (classes[0][0] if classes else None)
        return self.cfg.pool_placement.get(pool, self.cfg.placement)

    def full(self) -> bool:
        return self.state.free_whole_total() == 0 and not self.state.has_shared_room()

    def place(self, job: Job, classes: list[ClassKey], mode: str):
        """(gpu_ids, fractions) taken from the free index, or None."""
        if job.gpus >= 1:
            ids = self.state.place_whole(int(job.gpus), classes, mode)
            return (ids, {}) if ids else None
        got = self.state.place_fraction(job, classes, mode)
        return ([got[0]], {got[0]: job.gpus}) if got else None

    def start(self, job: Job, ids: list[str], fractions: dict[str, float]) -> None:
        proj = self.snap.projects.get(job.project)
        borrowed = self.tally.borrowed(job, proj)
        self.plan.starts.append(Start(job.id, ids, fractions, borrowed))
        self.tally.add(job)
        self.started.append(Allocation(job, ids, self.now, fractions, borrowed))

    def try_preempt(self, job: Job, classes: list[ClassKey]) -> bool:
        if not self.victims or self.preempt_attempts >= self.cfg.max_preempt_attempts:
            return False
        proj = self.snap.projects.get(job.project)
        if not self.tally.within_guarantee(job, proj):
            return False
        self.preempt_attempts += 1
        victims = self.victims.find(job, classes)
        if not victims:
            return False
        for a in victims:
            why = "borrowed" if a.borrowed and a.job.project != job.project else "preemptible"
            reason = (f"{why} GPUs reclaimed for job {job.id} of project {job.project}, "
                      f"which is within its guaranteed quota")
            self.plan.preemptions.append(Preemption(a.job.id, reason, job.id))
            self.preempted.add(a.job.id)
        self.tally.proj_claimed[job.project] = self.tally.proj_claimed.get(job.project, 0.0) + job.gpus
        self.codes[job.id] = (REASON_PREEMPTING,
                              f"Preempting {len(victims)} job(s) on borrowed or preemptible GPUs to "
                              f"make room within project {job.project}'s guarantee; starts in the next pass")
        return True

    def try_reserve(self, job: Job, classes: list[ClassKey], mode: str) -> bool:
        if not self.cfg.backfill or len(self.helds) >= self.cfg.max_reservations:
            return False
        running = [a for a in self.snap.running if a.job.id not in self.preempted] + self.started
        timeline = release_timeline(self.state, running, self.now)
        for a in self.snap.running:
            if a.job.id in self.preempted:  # their GPUs come back after the grace period
                timeline.insert(0, (self.now, [(g, UNITS if not a.fractions else int(a.fractions[g] * UNITS))
                                               for g in a.gpu_ids if g in self.state.gpu]))
        found = earliest_start(self.state, job, classes, mode, timeline)
        if found is None:
            return False
        t, ids = found
        h = reserve(self.state, job, t, ids)
        self.helds.append(h)
        self.plan.reservations.append(h.res)
        self.codes[job.id] = (REASON_RESOURCES,
                              f"Waiting for {fmt_gpus(job.gpus)}: next to start, GPUs reserved for it "
                              f"by {fmt_duration(max(0.0, t - self.now))} from now at the latest")
        return True

    def blocked_reason(self, job: Job, classes: list[ClassKey]) -> tuple[str, str]:
        for h in self.helds:
            if could_use(h, self.state, job, classes):
                room = h.res.start_time - self.now
                return (REASON_RESERVATION,
                        f"Waiting for {fmt_gpus(job.gpus)}: the free GPUs are reserved for higher-priority "
                        f"job {h.res.job_id}; a time limit under {fmt_duration(max(room, 0.0))} would let it start now")
        free = self.state.free_count(classes)
        return (REASON_RESOURCES, f"Waiting for {fmt_gpus(job.gpus)}: {free} whole GPU(s) of the kind "
                                  f"it asks for are free now")

    # -- the pass ----------------------------------------------------------
    def run(self) -> Plan:
        """1. Index free capacity and tally usage (done in __init__).
        2. Order the queue by the policy (fifo / multifactor / las).
        3. Walk the queue in that order, for each job:
           a. admission (quotas, budget, type, array throttle, dependencies); a
              refusal becomes its reason;
           b. a CPU-only job starts at once;
           c. place it on free GPUs (reserved GPUs excluded); on success start it,
              borrowed when it takes its project above the guarantee;
           d. else backfill: use reserved GPUs if it ends before that reservation;
           e. else, within its guarantee, pick victims to preempt (it starts in a
              later pass, once they are gone);
           f. else, if reservations are left (EASY: one), reserve its earliest
              start; with backfill off the first blocked job stops all later ones.
        4. Once no GPU is free, stop placing after `max_examine_full` attempts:
           later jobs are only admitted, considered for preemption and explained.
        5. Number the jobs still waiting in priority order (their position).
        """
        snap, cfg, state = self.snap, self.cfg, self.state
        order = order_queue(snap)
        explain = cfg.explain
        full = self.full()
        attempts_full = 0
        blocked_head: Job | None = None
        for job in order:
            proj = snap.projects.get(job.project)
            refusal = admit(job, proj, snap.orgs.get(job.org), self.tally, self.models)
            if refusal is not None:
                if explain:
                    self.codes[job.id] = refusal
                continue
            if job.gpus <= EPS:
                self.start(job, [], {})
                continue
            if full and (attempts_full >= cfg.max_examine_full) and not self.victims and not explain:
                continue
            classes = self.classes_for(job)
            need = int(job.gpus) if job.gpus >= 1 else 1
            if not classes or max((self.capacity[c] for c in classes), default=0) < need:
                self.codes[job.id] = (REASON_UNPLACEABLE,
                                      f"Asks for {fmt_gpus(job.gpus)} but no schedulable group of matching GPUs "
                                      f"is that large; resubmit with fewer GPUs or another type/pool")
                continue
            if blocked_head is not None:
                self.codes[job.id] = (REASON_PRIORITY,
                                      f"Waiting behind higher-priority job {blocked_head.id} (backfill is off)")
                continue
            mode = self.mode_for(job, classes)
            got = None
            if not full or attempts_full < cfg.max_examine_full:
                if full:
                    attempts_full += 1
                got = self.place(job, classes, mode)
                if got is None and self.helds:
                    usable = [h for h in self.helds
                              if self.now + job.time_limit <= h.res.start_time + EPS
                              and could_use(h, state, job, classes)]
                    if usable:
                        got = with_released(state, usable, lambda: self.place(job, classes, mode))
            if got is not None:
                self.start(job, *got)
                full = self.full()
                continue
            if self.try_preempt(job, classes):
                continue
            if self.try_reserve(job, classes, mode):
                full = self.full()
                continue
            if not cfg.backfill:
                blocked_head = job
            if explain:
                self.codes[job.id] = self.blocked_reason(job, classes)
        if explain:
            started = {s.job_id for s in self.plan.starts}
            pos = 0
            for job in order:
                if job.id in started:
                    continue
                pos += 1
                code, msg = self.codes.get(job.id) or (
                    REASON_PRIORITY, "Waiting behind higher-priority jobs; not examined in this pass")
                self.plan.waiting[job.id] = Reason(code, msg, pos)
        return self.plan


def schedule(snapshot: Snapshot, topology: Topology | None = None) -> Plan:
    """Run one scheduling pass over `snapshot` and return what to do.

    `topology` is an optional `Topology.from_nodes(snapshot.nodes)` kept by a
    caller whose nodes do not change between passes (the simulator); without
    it the pass builds its own, which is always correct."""
    return _Pass(snapshot, topology).run()
