"""The scheduling pass: snapshot in, plan out. No I/O, no clock, no Django."""
from __future__ import annotations

from .admission import EPS, Tally, admit, fmt_duration, fmt_gpus
from .backfill import Held, could_use, earliest_start, release_timeline, reserve, with_released
from .model import (
    REASON_FRAGMENTED, REASON_PREEMPTING, REASON_PRIORITY, REASON_RESERVATION, REASON_RESOURCES, REASON_SANDBOX, REASON_UNPLACEABLE,
    Allocation, Job, Plan, Preemption, ProjectQuota, Reason, Snapshot, Start, sandbox_hosts,
)
from .ordering import order_queue
from .placement import ClassKey, ClusterState, Topology
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
        self._victims: VictimPool | None = None  # built on the first preemption attempt
        self.preempted: set[str] = set()
        self.preempt_attempts = 0
        self.preempt_failed: dict[tuple, tuple[float, int]] = {}  # (project, classes) -> (min gpus, max qos)
        self._classes: dict[tuple, list[ClassKey]] = {}
        self.failed = 0  # admitted jobs that could not be placed, for max_failed_placements
        self.blocked_head: Job | None = None

    # -- helpers -----------------------------------------------------------
    def classes_for(self, job: Job) -> list[ClassKey]:
        proj = self.snap.projects.get(job.project)
        allowed = proj.allowed_gpu_types if proj else ()
        frac = 0 < job.gpus < 1
        key = (job.pool, job.gpu_type, job.gpu_memory_mb, allowed, frac, job.sandbox)
        out = self._classes.get(key)
        if out is None:
            hosts = sandbox_hosts(job.sandbox)
            out = [c for c in self.state.classes
                   if (job.pool is None or c[0] == job.pool) and c[4] in hosts
                   and (c[1] == job.gpu_type if job.gpu_type is not None else (not allowed or c[1] in allowed))
                   and (frac or c[2] >= job.gpu_memory_mb)
                   and (c[3] or not frac)]
            self._classes[key] = out
        return out

    def mode_for(self, job: Job, classes: list[ClassKey]) -> str:
        pool = job.pool if job.pool is not None else (classes[0][0] if classes else None)
        return self.cfg.pool_placement.get(pool, self.cfg.placement)

    def place(self, job: Job, classes: list[ClassKey], mode: str):
        """(gpu_ids, fractions) taken from the free index, or None."""
        if job.gpus >= 1:
            ids = self.state.place_whole(int(job.gpus), classes, mode, job.nodes)
            return (ids, {}) if ids else None
        got = self.state.place_fraction(job, classes, mode)
        return ([got[0]], {got[0]: job.gpus}) if got else None

    def start(self, job: Job, ids: list[str], fractions: dict[str, float]) -> None:
        proj = self.snap.projects.get(job.project)
        borrowed = self.tally.borrowed(job, proj)
        self.plan.starts.append(Start(job.id, ids, fractions, borrowed))
        self.tally.add(job)
        self.started.append(Allocation(job, ids, self.now, fractions, borrowed))

    def might_fit(self, job: Job) -> bool:
        """Cheap upper bound used only when nobody reads reasons: False when
        the job cannot start in this pass whatever its constraints, and its
        blocking would change nothing (the reservation is already taken)."""
        if self.cfg.backfill and len(self.helds) < self.cfg.max_reservations:
            return True  # it may be the job that gets the reservation
        if not self.cfg.backfill and self.blocked_head is None:
            return True  # it may be the job that blocks all later ones
        if job.gpus < 1:
            return self.state.has_shared_room() or any(self.helds)
        room = self.state.free_whole_total() + sum(sum(h.classes.values()) for h in self.helds)
        return job.gpus <= room

    @property
    def victims(self) -> VictimPool | None:
        if self._victims is None and self.cfg.preemption:
            self._victims = VictimPool(self.snap.running, self.now, self.cfg.min_runtime_s, self.state,
                                       self.tally, self.snap.projects)
        return self._victims

    def may_preempt(self) -> bool:
        return self.cfg.preemption and self.preempt_attempts < self.cfg.max_preempt_attempts \
            and (self._victims is None or bool(self._victims))

    def try_preempt(self, job: Job, classes: list[ClassKey]) -> bool:
        if not self.may_preempt():
            return False
        proj = self.snap.projects.get(job.project)
        if not self.tally.within_guarantee(job, proj):
            return False
        # Victims only get fewer within a pass: if a job of this project found
        # none, a larger job with no higher QoS finds none either.
        key = (job.project, id(classes), job.nodes)
        prev = self.preempt_failed.get(key)
        if prev is not None and job.gpus >= prev[0] and job.qos <= prev[1]:
            return False
        self.preempt_attempts += 1
        victims = self.victims.find(job, classes)
        if not victims:
            if prev is None or (job.gpus <= prev[0] and job.qos >= prev[1]):
                self.preempt_failed[key] = (job.gpus, job.qos)
            return False
        for a in victims:
            why = "borrowed" if a.borrowed and a.job.project != job.project else "preemptible"
            reason = (f"{why} GPUs reclaimed for job {job.id} of project {job.project}, "
                      f"which is within its guaranteed quota")
            self.plan.preemptions.append(Preemption(a.job.id, reason, job.id))
            self.preempted.add(a.job.id)
        self.tally.proj_claimed[job.project] = self.tally.proj_claimed.get(job.project, 0.0) + job.gpus
        defrag = (f" on {self.where(job)} (enough GPUs are free, but spread over other nodes)"
                  if job.id in self.plan.fragmented else "")
        self.codes[job.id] = (REASON_PREEMPTING,
                              f"Preempting {len(victims)} job(s) on borrowed or preemptible GPUs to "
                              f"make room{defrag} within project {job.project}'s guarantee; starts in the next pass")
        return True

    def try_reserve(self, job: Job, classes: list[ClassKey], mode: str) -> bool:
        if not self.cfg.backfill or len(self.helds) >= self.cfg.max_reservations:
            return False
        if self.preempted:  # their GPUs come back after the grace period: count them as ending now
            gone = [a for a in self.snap.running if a.job.id in self.preempted]
            running = [a for a in self.snap.running if a.job.id not in self.preempted] + self.started
        else:
            gone, running = [], self.snap.running + self.started
        timeline = release_timeline(self.state, running, self.now, gone)
        found = earliest_start(self.state, job, classes, mode, timeline)
        if found is None:
            return False
        t, ids = found
        h = reserve(self.state, job, t, ids)
        self.helds.append(h)
        self.plan.reservations.append(h.res)
        when = (f"in {fmt_duration(t - self.now)} at the latest" if t > self.now
                else "as soon as jobs past their time limit end")
        if job.id in self.plan.fragmented:
            # Backfill defragments for it: later jobs may not take the reserved node's GPUs.
            nodes = ", ".join(dict.fromkeys(self.state.gpu[i].node for i in ids))
            self.codes[job.id] = (REASON_FRAGMENTED, self.fragmented_message(job) +
                                  f"; next to start, GPUs on {nodes} reserved for it {when}")
            return True
        self.codes[job.id] = (REASON_RESOURCES,
                              f"Waiting for {fmt_gpus(job.gpus)}: next to start, GPUs reserved for it {when}")
        return True

    @staticmethod
    def where(job: Job) -> str:
        return "one node" if job.nodes <= 1 else f"{job.nodes} nodes"

    def fragmented_message(self, job: Job) -> str:
        free = self.plan.fragmented[job.id]
        if job.nodes <= 1:
            return f"fragmented: {free} GPUs free but no node has {int(job.gpus)}"
        return (f"fragmented: {free} GPUs free but fewer than {job.nodes} nodes have "
                f"{job.gpus_per_node} each")

    def blocked_reason(self, job: Job, classes: list[ClassKey]) -> tuple[str, str]:
        if job.id in self.plan.fragmented:
            return REASON_FRAGMENTED, self.fragmented_message(job)
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
    def consider(self, job: Job, proj: ProjectQuota | None, borrowing: bool) -> None:
        """Steps 3a, 3b and 3d-3g for one job (the caller did 3c)."""
        snap, cfg, state = self.snap, self.cfg, self.state
        gpus = job.gpus
        placing = self.failed < cfg.max_failed_placements
        refusal = admit(job, proj, snap.orgs.get(job.org), self.tally, self.models)
        if refusal is not None:
            if cfg.explain:
                self.codes[job.id] = refusal
            return
        if gpus <= EPS:
            self.start(job, [], {})
            return
        classes = self.classes_for(job)
        need = int(gpus) if gpus >= 1 else 1
        per, nodes = (job.gpus_per_node, job.nodes) if gpus >= 1 else (1, 1)
        if not classes and self.state.classes and not any(c[4] in sandbox_hosts(job.sandbox)
                                                          for c in self.state.classes):
            self.codes[job.id] = (REASON_SANDBOX, f"Asks for the {job.sandbox} sandbox, which no schedulable node "
                                                  f"with GPUs offers now")
            return
        topo = self.state.topo
        if not classes or not any(topo.fits(c, per, nodes) for c in classes):
            if classes and nodes == 1 and max(self.capacity[c] for c in classes) >= need:
                biggest = max(topo.sizes[c][0] for c in classes)
                self.codes[job.id] = (REASON_UNPLACEABLE,
                                      f"Asks for {fmt_gpus(gpus)} on one node but the largest matching node has "
                                      f"{biggest}; resubmit with nodes and gpus_per_node to span nodes")
            else:
                self.codes[job.id] = (REASON_UNPLACEABLE,
                                      f"Asks for {fmt_gpus(gpus)} on {self.where(job)} but no schedulable group of "
                                      f"matching GPUs is that large; resubmit with fewer GPUs or another type/pool")
            return
        if self.blocked_head is not None:
            self.codes[job.id] = (REASON_PRIORITY,
                                  f"Waiting behind higher-priority job {self.blocked_head.id} (backfill is off)")
            return
        mode = self.mode_for(job, classes)
        got = None
        if placing:
            got = self.place(job, classes, mode)
            if got is None and self.helds:
                usable = [h for h in self.helds
                          if self.now + job.time_limit <= h.res.start_time + EPS
                          and could_use(h, state, job, classes)]
                if usable:
                    got = with_released(state, usable, lambda: self.place(job, classes, mode))
            if got is not None:
                self.start(job, *got)
                return
            self.failed += 1
            free = state.fragmented_free(job, classes)
            if free:
                self.plan.fragmented[job.id] = free
        if not borrowing and self.try_preempt(job, classes):
            return
        if not placing or not self.try_reserve(job, classes, mode):
            if not cfg.backfill:
                self.blocked_head = job
            if cfg.explain:
                self.codes[job.id] = self.blocked_reason(job, classes)
        if borrowing and cfg.explain:
            code, msg = self.codes[job.id]
            self.codes[job.id] = (code, msg + f"; above project {job.project}'s guarantee it only gets "
                                              f"GPUs that jobs within their guarantee leave idle")

    def run(self) -> Plan:
        """1. Index free capacity and tally usage (done in __init__).
        2. Order the queue by the policy (fifo / multifactor / las).
        3. Walk the queue in that order, for each job:
           a. admission (quotas, budget, type, array throttle, dependencies); a
              refusal becomes its reason;
           b. a CPU-only job starts at once;
           c. a job that would take its project above its guarantee (borrow) is
              deferred to step 4: borrowing only uses capacity that jobs within
              their guarantee leave idle;
           d. place it on free GPUs (reserved GPUs excluded) and start it;
           e. else backfill: use reserved GPUs if it ends before that reservation;
           f. else pick victims to preempt (it starts in a later pass, once they
              are gone);
           g. else, if reservations are left (EASY: one), reserve its earliest
              start; with backfill off the first blocked job stops all later ones.
        4. Walk the deferred borrowing jobs in the same order: re-admit, place,
           backfill or reserve as above, never preempt; starts carry borrowed=True.
        5. After `max_failed_placements` jobs failed to place (Slurm's
           bf_max_job_test), stop placing: later jobs are only admitted,
           considered for preemption and explained (with explain off, a job
           that could not preempt is not even admitted).
        6. Number the jobs still waiting in priority order (their position).
        """
        order = order_queue(self.snap)
        cfg, projects, used = self.cfg, self.snap.projects, self.tally.proj_gpus
        explain, depth = cfg.explain, cfg.max_failed_placements
        deferred = []
        # The two loops below inline the cheap tests (borrowing, search depth)
        # because they run for every queued job in every pass.
        for job in order:
            proj = projects.get(job.project)
            g = job.gpus
            if g > EPS and used.get(job.project, 0.0) + g > (proj.guaranteed_gpus if proj else 0.0) + EPS:
                deferred.append((job, proj))
            elif explain or g <= EPS or self.may_preempt() or (self.failed < depth and self.might_fit(job)):
                self.consider(job, proj, False)
        for job, proj in deferred:
            if explain or (self.failed < depth and self.might_fit(job)):
                self.consider(job, proj, self.tally.borrowed(job, proj))
        if self.cfg.explain:
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
