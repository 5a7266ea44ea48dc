"""The scheduling pass: snapshot in, plan out. No I/O, no clock, no Django."""
from __future__ import annotations

import math

from .admission import EPS, Tally, admit, fmt_duration, fmt_gpus
from .backfill import Held, could_use, earliest_start, release_timeline, reserve, with_released
from .model import (
    REASON_FRAGMENTED, REASON_LOCALITY, REASON_NODE_RESOURCES, REASON_PREEMPTING, REASON_PRIORITY,
    REASON_RESERVATION, REASON_RESOURCES, REASON_SANDBOX, REASON_UNPLACEABLE,
    Allocation, Dataset, Job, Plan, Preemption, ProjectQuota, Reason, Snapshot, Start, sandbox_hosts,
)
from .ordering import las_queue_running, las_queue_waiting, order_queue
from .placement import UNITS, ClassKey, ClusterState, Topology, fmt_mem, frac_units
from .preempt import VictimPool, las_candidates, next_checkpoint


class _Pass:
    """State of one pass; `schedule()` is the public entry point."""

    def __init__(self, snap: Snapshot, topology: Topology | None):
        self.snap = snap
        self.cfg = snap.config
        self.now = snap.now
        self.state = ClusterState.build(snap.nodes, snap.running, topology,
                                        reserve=(self.cfg.node_reserved_cpus, self.cfg.node_reserved_memory_mb))
        self.tally = Tally.from_running(snap.running)
        self.models = self.state.topo.models
        self.capacity = self.state.topo.capacity
        self.plan = Plan()
        self.codes: dict[str, tuple[str, str]] = {}
        self.started: list[Allocation] = []
        self.helds: list[Held] = []
        self.easy_held = 0  # of them EASY backfill's (max_reservations); the others hold a locality wait's GPUs
        self._victims: VictimPool | None = None  # built on the first preemption attempt
        self._las_victims: VictimPool | None = None  # the las rule's pool, likewise
        self.las_later: list[Allocation] = []  # checkpointing jobs the las rule waits to take after a save
        self.las_used = self.cfg.policy == "las" or "las" in self.cfg.pool_policy.values()
        self.preempted: set[str] = set()
        self.preempt_attempts = 0
        self.preempt_failed: dict[tuple, tuple[float, int]] = {}  # (project, classes) -> (min gpus, max qos)
        self._classes: dict[tuple, list[ClassKey]] = {}
        self._too_big: dict[tuple, str | None] = {}  # (classes, cpus, memory) -> why no node could hold it
        self.failed = 0  # admitted jobs that could not be placed, for max_failed_placements
        self.blocked_head: Job | None = None
        # Explain only: job id -> (ids of the reservations holding GPUs it would fit on, seconds
        # until the first of them starts). Found by a trial placement, so the hint is true.
        self.reserved_for: dict[str, tuple[list[str], float]] = {}
        # Dataset locality, built only when a queued job names datasets: digest -> the schedulable
        # nodes whose cache holds it; node -> its cached digests; job id -> the nodes holding all of
        # its datasets while it waits for one of them, and how much longer it waits.
        self._holders: dict[str, list[str]] | None = None
        self._cached: dict[str, frozenset[str] | set[str]] | None = None
        self.locality_wait: dict[str, tuple[float, list[str], list[str]]] = {}

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
        """(gpu_ids, fractions) taken from the free index, or None. A job naming datasets tries the
        nodes holding the most of its bytes first (the locality bonus), then fewer, then any."""
        if job.datasets:
            tiers = self.locality_tiers(job)
            if tiers:
                state = self.state
                try:
                    for nodes in tiers:
                        state.only = nodes
                        got = self._place(job, classes, mode)
                        if got is not None:
                            return got
                finally:
                    state.only = None
        return self._place(job, classes, mode)

    def _place(self, job: Job, classes: list[ClassKey], mode: str):
        if job.gpus >= 1:
            ids = self.state.place_whole(int(job.gpus), classes, mode, job.nodes, job)
            return (ids, {}) if ids else None
        got = self.state.place_fraction(job, classes, mode)
        return ([got[0]], {got[0]: job.gpus}) if got else None

    # -- dataset locality ------------------------------------------------------
    @staticmethod
    def data_of(job: Job) -> dict[str, Dataset]:
        """A job's datasets by digest (one named twice counts once)."""
        return {d.digest: d for d in job.datasets}

    def local_bytes(self, job: Job) -> dict[str, int]:
        """Schedulable node -> bytes of `job`'s datasets its cache holds (nodes holding none left
        out). A dataset of unknown size (0) counts as one byte, so holding it still counts."""
        if self._holders is None:
            self._holders = {}
            for n in self.snap.nodes:
                if n.schedulable:
                    for digest in n.datasets:
                        self._holders.setdefault(digest, []).append(n.name)
        out: dict[str, int] = {}
        for d in self.data_of(job).values():
            for n in self._holders.get(d.digest, ()):
                out[n] = out.get(n, 0) + max(d.size, 1)
        return out

    def locality_tiers(self, job: Job) -> list[set[str]]:
        """Node sets to try in turn: those holding the most of the job's bytes, then those holding
        at least the next amount, ...; empty when no node holds any of its datasets."""
        local = self.local_bytes(job)
        return [{n for n, b in local.items() if b >= v} for v in sorted(set(local.values()), reverse=True)]

    def lacking(self, node: str, job: Job) -> list[Dataset]:
        """`job`'s datasets that `node`'s cache does not hold."""
        if self._cached is None:
            self._cached = {n.name: n.datasets for n in self.snap.nodes}
        have = self._cached.get(node, frozenset())
        return [d for d in self.data_of(job).values() if d.digest not in have]

    def could_hold(self, node: str, job: Job) -> bool:
        """Has `node` the CPUs and memory for `job` with nothing else running (or no known size)?"""
        size = self.state.size.get(node)
        return size is None or (size[0] + 1e-6 >= job.cpus and size[1] >= job.memory_mb)

    def place_job(self, job: Job, classes: list[ClassKey], mode: str):
        """`place`, except that a job which would start on a node lacking some of its datasets while
        a node holding them all is busy waits for it (Config.locality_wait_s after it entered the
        queue at most): the placement is given back, `locality_wait` notes the job, None."""
        got = self.place(job, classes, mode)
        wait_s = self.cfg.locality_wait_s
        if got is None or not job.datasets or wait_s <= 0:
            return got
        left = (job.queued_since if job.queued_since is not None else job.submit_time) + wait_s - self.now
        if left <= 0:
            return got
        state = self.state
        ids, fractions = got
        if not any(self.lacking(n, job) for n in dict.fromkeys(state.gpu[g].node for g in ids)):
            return got
        total = sum(max(d.size, 1) for d in self.data_of(job).values())
        per = job.gpus_per_node if job.gpus >= 1 else 1
        sizes = state.topo.node_size
        full = [n for n, b in self.local_bytes(job).items()
                if b >= total and any(sizes.get((c, n), 0) >= per for c in classes)
                and self.could_hold(n, job) and n not in job.avoid_nodes]
        if len(full) < max(job.nodes, 1):
            return got  # no node (or too few for its gang) holding all of its data could take it
        for gid in ids:
            state.untake(gid, frac_units(job, state.cls_of[gid][2]) if gid in fractions else UNITS)
        self.locality_wait[job.id] = (left, sorted(full), ids)
        return None

    def locality_reason(self, job: Job) -> tuple[str, str]:
        left, full, _ = self.locality_wait[job.id]
        names = ", ".join(d.label for d in self.data_of(job).values())
        where = ", ".join(full[:3]) + (f" and {len(full) - 3} more" if len(full) > 3 else "")
        return (REASON_LOCALITY,
                f"Waiting up to {fmt_duration(math.ceil(left))} more for a node that holds {names} "
                f"({where}, busy now); then it starts on any node with free GPUs and stages its data there")

    def policy_of(self, job: Job) -> str:
        pools = self.cfg.pool_policy
        return pools.get(job.pool, self.cfg.policy) if pools and job.pool is not None else self.cfg.policy

    def blocking(self, job: Job) -> str:
        """What a job that cannot start does to later ones: `strict` (fifo, or backfill off)
        blocks them all; `easy` (multifactor, las) gets a reservation they may not delay;
        `firstfit` (fifo-backfill) nothing, every later job that fits starts."""
        pol = self.policy_of(job)
        if pol == "fifo" or not self.cfg.backfill:
            return "strict"
        return "firstfit" if pol == "fifo-backfill" else "easy"

    def guarantee_first(self, job: Job) -> bool:
        """Is this job, when it would borrow, deferred behind jobs within their guarantee?
        Only under multifactor: fifo keeps submit order whatever the quota, las attained service."""
        return self.cfg.quotas and self.policy_of(job) == "multifactor"

    def start(self, job: Job, ids: list[str], fractions: dict[str, float], node: str | None = None) -> None:
        proj = self.snap.projects.get(job.project)
        borrowed = self.cfg.quotas and self.tally.borrowed(job, proj)
        self.plan.starts.append(Start(job.id, ids, fractions, borrowed, node))
        self.tally.add(job)
        self.state.take_room([node] if node else dict.fromkeys(self.state.gpu[g].node for g in ids), job)
        self.started.append(Allocation(job, ids, self.now, fractions, borrowed, node))

    # -- node CPUs and memory -----------------------------------------------
    @staticmethod
    def needs(job: Job) -> str:
        parts = [f"{job.cpus:g} CPU{'' if job.cpus == 1 else 's'}"] if job.cpus > 0 else []
        parts += [f"{fmt_mem(job.memory_mb)} of memory"] if job.memory_mb > 0 else []
        return " and ".join(parts)

    def start_cpu_only(self, job: Job) -> None:
        """A CPU-only job starts at once on a node with room for it, or waits saying why."""
        hosts = sandbox_hosts(job.sandbox)
        node = self.state.place_cpu(job, hosts)
        if node is not None:
            self.start(job, [], {}, node)
            return
        cands = self.state.cpu_nodes(job, hosts)
        if not cands:
            self.codes[job.id] = (REASON_SANDBOX, f"Asks for the {job.sandbox} sandbox, which no ready node offers now")
        elif (why := self.state.too_big(job, cands)) is not None:
            self.codes[job.id] = (REASON_NODE_RESOURCES, f"Asks for {self.needs(job)} on one node, more than any "
                                                         f"node offering its sandbox has: {why}")
        else:
            self.codes[job.id] = (REASON_NODE_RESOURCES, f"Waiting for {self.needs(job)} on one node: no node "
                                                         f"offering its sandbox has that much free now")

    def room_blocked(self, job: Job, classes: list[ClassKey]) -> bool:
        """After `job` failed to place: were its GPUs free, so that CPUs or memory kept it off them?"""
        st = self.state
        if not st.room or (job.cpus <= 0 and job.memory_mb <= 0):
            return False
        if job.gpus < 1:
            return any(c[3] and (st.total_free[c] or any(
                ids and u >= frac_units(job, c[2]) for u, ids in (st.rem_buckets.get(c) or {}).items()))
                for c in classes)
        per = job.gpus_per_node
        return any(sum(1 for ids in st.free[c].values() if len(ids) >= per) >= job.nodes for c in classes)

    def might_fit(self, job: Job) -> bool:
        """Cheap upper bound used only when nobody reads reasons: False when
        the job cannot start in this pass whatever its constraints, and its
        blocking would change nothing (the reservation is already taken)."""
        mode = self.blocking(job)
        if mode == "easy" and self.easy_held < self.cfg.max_reservations:
            return True  # it may be the job that gets the reservation
        if mode == "strict" and self.blocked_head is None:
            return True  # it may be the job that blocks all later ones
        if job.gpus < 1:
            return self.state.has_shared_room() or any(self.helds)
        room = self.state.free_whole_total() + sum(sum(h.classes.values()) for h in self.helds)
        return job.gpus <= room

    @property
    def victims(self) -> VictimPool | None:
        if self._victims is None and self.cfg.preemption:
            self._victims = VictimPool(self.snap.running, self.now, self.cfg.min_runtime_s, self.state,
                                       self.tally, self.snap.projects, taken=self.preempted)
        return self._victims

    @property
    def las_victims(self) -> VictimPool:
        if self._las_victims is None:
            now, cfg = self.now, self.cfg
            queue_of = {a.job.id: las_queue_running(a, now, cfg) for a in self.snap.running}
            queue_of.update((j.id, las_queue_waiting(j, now, cfg)) for j in self.snap.queued)
            running, self.las_later = las_candidates(self.snap.running, now, cfg)
            self._las_victims = VictimPool(running, now, cfg.min_runtime_s, self.state, self.tally,
                                           self.snap.projects, queue_of=queue_of, taken=self.preempted)
        return self._las_victims

    def may_preempt(self) -> bool:
        """Might some job still preempt in this pass (for a guarantee, or by the las rule)?"""
        if not self.cfg.preemption or self.preempt_attempts >= self.cfg.max_preempt_attempts:
            return False
        if self.cfg.quotas and (self._victims is None or bool(self._victims)):
            return True
        return self.las_used and (self._las_victims is None or bool(self._las_victims) or bool(self.las_later))

    def las_wake(self, q: int) -> None:
        """A job of LAS queue `q` found no victim: jobs of a higher queue passed over until their next
        own save may be victims then; the plan says when the first of them saves."""
        queue_of = self.las_victims.queue_of
        wake = min((next_checkpoint(a, self.now) for a in self.las_later
                    if queue_of[a.job.id] > q and a.job.id not in self.preempted), default=None)
        if wake is not None and (self.plan.next_pass_at is None or wake < self.plan.next_pass_at):
            self.plan.next_pass_at = wake

    def try_preempt_las(self, job: Job, classes: list[ClassKey]) -> bool:
        """Tiresias' rule: preempt running work of a higher LAS queue (more attained service)."""
        cfg = self.cfg
        if not cfg.preemption or self.preempt_attempts >= cfg.max_preempt_attempts \
                or self.policy_of(job) != "las":
            return False
        pool = self.las_victims
        q = pool.queue_of[job.id]
        if not pool:
            self.las_wake(q)
            return False
        # As for guarantees: if a job found none, a larger one of no lower queue finds none.
        key = ("las", id(classes), job.nodes)
        prev = self.preempt_failed.get(key)
        if prev is not None and job.gpus >= prev[0] and q >= prev[1]:
            return False
        self.preempt_attempts += 1
        victims = pool.find(job, classes)
        if not victims:
            if prev is None or (job.gpus <= prev[0] and q <= prev[1]):
                self.preempt_failed[key] = (job.gpus, q)
            self.las_wake(q)
            return False
        mine = job.attained_gpu_s / 3600
        for a in victims:
            had = (a.job.attained_gpu_s + max(a.job.gpus, 0.0) * (self.now - a.start_time)) / 3600
            self.plan.preemptions.append(Preemption(
                a.job.id, f"least attained service first: it has had {had:.2f} GPU-hours, job {job.id} "
                          f"{mine:.2f}", job.id))
        self.codes[job.id] = (REASON_PREEMPTING,
                              f"Preempting {len(victims)} job(s) that have had more GPU-service than it "
                              f"({mine:.2f} GPU-hours; least attained service first); starts in the next pass")
        return True

    def try_preempt(self, job: Job, classes: list[ClassKey]) -> bool:
        # Under las only attained service decides who preempts whom: a guarantee would fight it.
        if not self.cfg.quotas or self.policy_of(job) == "las" or not self.cfg.preemption or self.preempt_attempts >= self.cfg.max_preempt_attempts \
                or (self._victims is not None and not self._victims):
            return False  # without quotas no job is within a guarantee to preempt for
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
        if self.blocking(job) != "easy" or self.easy_held >= self.cfg.max_reservations:
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
        self.easy_held += 1
        self.plan.reservations.append(h.res)
        horizon = self.cfg.prefetch_horizon_s
        if job.datasets and horizon > 0 and t - self.now <= horizon:  # its nodes fetch what they lack
            for node in dict.fromkeys(self.state.gpu[i].node for i in ids):
                fetch = self.plan.prefetch.setdefault(node, [])
                fetch += [d for d in self.lacking(node, job) if d not in fetch]
                if not fetch:
                    del self.plan.prefetch[node]
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

    def fits_with(self, job: Job, classes: list[ClassKey], helds: list[Held]) -> bool:
        """Would `job` fit now were these reservations' GPUs free? Read-only (used only to
        explain), so that explaining never changes what the pass decides: the same test
        `place_whole`/`place_fraction` make, with the held GPUs counted as free."""
        st = self.state
        if job.gpus < 1:
            return any(st.cls_of[gid] in classes and st.cls_of[gid][3]
                       and st.free_units(gid) + u >= frac_units(job, st.cls_of[gid][2])
                       for h in helds for gid, u in h.held.items())
        extra: dict[tuple, int] = {}
        for h in helds:
            for gid, u in h.held.items():
                if u == UNITS:
                    key = (st.cls_of[gid], st.gpu[gid].node)
                    extra[key] = extra.get(key, 0) + 1
        per = job.gpus_per_node

        def nodes_with_room(cls: ClassKey) -> int:
            # Nodes with `per` GPUs free already (the free-count buckets: no walk over the class's
            # nodes, which explaining 200 jobs on 1,000 nodes made a third of a pass's core), and
            # those the held GPUs bring up to it.
            free, buckets = st.free[cls], st.buckets[cls]
            return (sum(len(buckets[k]) for k in range(per, len(buckets)))
                    + sum(1 for (c, node), n in extra.items()
                          if c == cls and node in free and len(free[node]) < per <= len(free[node]) + n))

        return any(nodes_with_room(cls) >= job.nodes for cls in classes)

    def note_reserved(self, job: Job, classes: list[ClassKey]) -> None:
        """After `job` failed to place: if it fits on GPUs reservations hold, remember which
        and how soon the first starts, for a reason that names them. Its own time limit was
        what kept it off them (a job that ends before a reservation may use its GPUs)."""
        helds = [h for h in self.helds if could_use(h, self.state, job, classes)]
        if helds and self.fits_with(job, classes, helds):
            room = min(h.res.start_time for h in helds) - self.now
            self.reserved_for[job.id] = ([h.res.job_id for h in helds], room)

    def blocked_reason(self, job: Job, classes: list[ClassKey], placing: bool) -> tuple[str, str]:
        if job.id in self.plan.fragmented:
            return REASON_FRAGMENTED, self.fragmented_message(job)
        if not placing:
            return self.not_examined()
        found = self.reserved_for.get(job.id)
        if found is not None:
            ids, room = found
            # The hint only where it is true: a limit under `room` makes every one of these
            # reservations usable, and the trial placement showed the job then fits.
            hint = (f"; a time limit under {fmt_duration(room)} would let it start now"
                    if 0 < room < job.time_limit else "")
            return (REASON_RESERVATION,
                    f"Waiting for {fmt_gpus(job.gpus)}: the free GPUs it fits on are reserved for higher-priority "
                    f"job {', '.join(ids)}{hint}")
        free = self.state.free_count(classes)
        return (REASON_RESOURCES, f"Waiting for {fmt_gpus(job.gpus)}: {free} whole GPU(s) of the kind "
                                  f"it asks for are free now")

    def not_examined(self) -> tuple[str, str]:
        return (REASON_PRIORITY,
                f"Waiting behind higher-priority jobs; not examined in this pass (a pass stops placing after "
                f"{self.cfg.max_failed_placements} jobs could not start)")

    def behind_head(self) -> tuple[str, str]:
        head = self.blocked_head
        why = "strict FIFO: no job starts ahead of it" if self.policy_of(head) == "fifo" else "backfill is off"
        return REASON_PRIORITY, f"Waiting behind higher-priority job {head.id}, which cannot start yet ({why})"

    # -- the pass ----------------------------------------------------------
    def refused(self, job: Job, proj: ProjectQuota | None) -> tuple[str, str] | None:
        """Steps 3a and the static checks: a reason the job cannot start in this pass
        whatever else happens (admission, sandbox, too large for any node group), or None.
        Changes nothing, so a job the pass skips is explained by the same rules."""
        refusal = admit(job, proj, self.snap.orgs.get(job.org), self.tally, self.models)
        if refusal is not None or job.gpus <= EPS:
            return refusal
        gpus = job.gpus
        classes = self.classes_for(job)
        need = int(gpus) if gpus >= 1 else 1
        per, nodes = (job.gpus_per_node, job.nodes) if gpus >= 1 else (1, 1)
        if not classes and self.state.classes and not any(c[4] in sandbox_hosts(job.sandbox)
                                                          for c in self.state.classes):
            return (REASON_SANDBOX, f"Asks for the {job.sandbox} sandbox, which no schedulable node "
                                    f"with GPUs offers now")
        topo = self.state.topo
        if classes and self.state.size and (job.cpus > 0 or job.memory_mb > 0):
            key = (tuple(classes), job.cpus, job.memory_mb)
            if key not in self._too_big:  # jobs asking alike share the answer: refused() runs for every job
                near = {node for cls, node, _ in topo.groups if cls in classes}
                self._too_big[key] = self.state.too_big(job, [n for n in self.state.nodes if n.name in near])
            why = self._too_big[key]
            if why is not None:
                return (REASON_NODE_RESOURCES, f"Asks for {self.needs(job)} beside its GPUs on each node, more "
                                               f"than any node with such GPUs has: {why}")
        if not classes or not any(topo.fits(c, per, nodes) for c in classes):
            if classes and nodes == 1 and max(self.capacity[c] for c in classes) >= need:
                biggest = max(topo.sizes[c][0] for c in classes)
                return (REASON_UNPLACEABLE,
                        f"Asks for {fmt_gpus(gpus)} on one node but the largest matching node has "
                        f"{biggest}; resubmit with nodes and gpus_per_node to span nodes")
            return (REASON_UNPLACEABLE,
                    f"Asks for {fmt_gpus(gpus)} on {self.where(job)} but no schedulable group of "
                    f"matching GPUs is that large; resubmit with fewer GPUs or another type/pool")
        return None

    def explain_skipped(self, job: Job, proj: ProjectQuota | None) -> None:
        """The reason of a job the pass did not examine (explain only; decides nothing)."""
        refusal = self.refused(job, proj)
        if refusal is not None:
            self.codes[job.id] = refusal
        elif self.blocked_head is not None and self.blocking(job) == "strict":
            self.codes[job.id] = self.behind_head()
        elif self.failed >= self.cfg.max_failed_placements:
            self.codes[job.id] = self.not_examined()
        elif job.gpus < 1:
            self.codes[job.id] = (REASON_RESOURCES, f"Waiting for {fmt_gpus(job.gpus)}: no shared GPU has room now")
        else:  # might_fit: fewer GPUs free, of any kind, than it asks for, even counting reserved ones
            free = self.state.free_whole_total()
            held = sum(sum(h.classes.values()) for h in self.helds)
            self.codes[job.id] = (REASON_RESOURCES, f"Waiting for {fmt_gpus(job.gpus)}: {free} whole GPU(s) free now "
                                                    f"and {held} reserved for higher-priority jobs")

    def consider(self, job: Job, proj: ProjectQuota | None, borrowing: bool) -> None:
        """Steps 3a, 3b and 3d-3g for one job (the caller did 3c)."""
        cfg, state = self.cfg, self.state
        placing = self.failed < cfg.max_failed_placements
        refusal = self.refused(job, proj)
        if refusal is not None:
            self.codes[job.id] = refusal
            return
        if job.gpus <= EPS:
            self.start_cpu_only(job)
            return
        classes = self.classes_for(job)
        blocking = self.blocking(job)
        if self.blocked_head is not None and blocking == "strict":
            self.codes[job.id] = self.behind_head()
            return
        mode = self.mode_for(job, classes)
        got = None
        if placing:
            got = self.place_job(job, classes, mode)
            fallback = self.locality_wait[job.id][2] if job.id in self.locality_wait else None
            if got is None and self.helds:
                usable = [h for h in self.helds
                          if self.now + job.time_limit <= h.res.start_time + EPS
                          and could_use(h, state, job, classes)]
                if usable:
                    got = with_released(state, usable, lambda: self.place_job(job, classes, mode))
            if got is not None:
                self.locality_wait.pop(job.id, None)
                self.start(job, *got)
                return
            if job.id in self.locality_wait:
                # It could start now, on nodes without its data: it waits a little for one with it.
                # The free GPUs it would take are held for it until its wait ends (later jobs use
                # them only if they end by then), so that it can still take them then.
                if blocking == "strict":
                    self.blocked_head = job
                until = self.plan.locality_waits[job.id] = self.now + self.locality_wait[job.id][0]
                if fallback:
                    h = reserve(state, job, until, fallback)
                    self.helds.append(h)
                    self.plan.reservations.append(h.res)
                if cfg.explain:
                    self.codes[job.id] = self.locality_reason(job)
                return
            self.failed += 1
            if self.room_blocked(job, classes):
                # GPUs would do, CPUs or memory beside them do not: no reservation of GPUs helps that.
                if blocking == "strict":
                    self.blocked_head = job
                self.codes[job.id] = (REASON_NODE_RESOURCES, f"Waiting for {self.needs(job)} beside its "
                                                             f"{fmt_gpus(job.gpus)}: the nodes where they are free "
                                                             f"have not that much free now")
                return
            free = state.fragmented_free(job, classes)
            if free:
                self.plan.fragmented[job.id] = free
            if cfg.explain and self.helds:
                self.note_reserved(job, classes)
        if (not borrowing and self.try_preempt(job, classes)) or (self.las_used and self.try_preempt_las(job, classes)):
            if blocking == "strict":
                self.blocked_head = job  # head of line: nothing behind it starts, not even on other GPUs
            return
        if not placing or not self.try_reserve(job, classes, mode):
            if blocking == "strict":
                self.blocked_head = job
            if cfg.explain:
                self.codes[job.id] = self.blocked_reason(job, classes, placing)
        if borrowing and cfg.explain and self.guarantee_first(job):
            code, msg = self.codes[job.id]
            self.codes[job.id] = (code, msg + f"; above project {job.project}'s guarantee it only gets "
                                              f"GPUs that jobs within their guarantee leave idle")

    def run(self) -> Plan:
        """1. Index free capacity and tally usage (done in __init__).
        2. Order the queue by the policy (fifo / fifo-backfill / multifactor / las).
        3. Walk the queue in that order, for each job:
           a. admission (quotas, budget, type, array throttle, dependencies); a
              refusal becomes its reason, and the job blocks no other;
           b. a CPU-only job starts at once;
           c. under multifactor with quotas on, a job that would take its project
              above its guarantee (borrow) is deferred to step 4: borrowing only
              uses capacity that jobs within their guarantee leave idle (fifo and
              las keep their own order whatever the quota);
           d. place it on free GPUs (reserved GPUs excluded) and start it;
           e. else backfill: use reserved GPUs if it ends before that reservation;
           f. else pick victims to preempt (it starts in a later pass, once they
              are gone);
           g. else by the policy's blocking mode: `easy` reserves its earliest start
              if reservations are left (one), `strict` (fifo, or backfill off) makes
              it the head of line that no later job passes, `firstfit`
              (fifo-backfill) lets later jobs take whatever fits.
        4. Walk the deferred borrowing jobs in the same order: re-admit, place,
           backfill or reserve as above, never preempt; starts carry borrowed=True.
        5. After `max_failed_placements` jobs failed to place (Slurm's
           bf_max_job_test), stop placing: later jobs are only admitted and
           considered for preemption. A job that can start neither way in this
           pass (`might_fit`) is skipped; with `explain` it still gets a reason,
           by read-only checks, so explain never changes a decision.
        6. Number the jobs still waiting in priority order (their position).
        """
        order = order_queue(self.snap)
        cfg, projects, used = self.cfg, self.snap.projects, self.tally.proj_gpus
        explain, depth = cfg.explain, cfg.max_failed_placements
        quotas = cfg.quotas
        uniform = not cfg.pool_policy
        defer_all = uniform and self.guarantee_first(order[0]) if order else False
        deferred = []
        # The two loops below inline the cheap tests (borrowing, search depth)
        # because they run for every queued job in every pass.
        for job in order:
            proj = projects.get(job.project)
            g = job.gpus
            borrowing = quotas and g > EPS and \
                used.get(job.project, 0.0) + g > (proj.guaranteed_gpus if proj else 0.0) + EPS
            if borrowing and (defer_all if uniform else self.guarantee_first(job)):
                deferred.append((job, proj))
            elif g <= EPS or self.may_preempt() or (self.failed < depth and self.might_fit(job)):
                self.consider(job, proj, borrowing)
            elif explain:
                self.explain_skipped(job, proj)
        for job, proj in deferred:
            if self.failed < depth and self.might_fit(job):
                self.consider(job, proj, self.tally.borrowed(job, proj))
            elif explain:
                self.explain_skipped(job, proj)
        if self.cfg.explain:
            started = {s.job_id for s in self.plan.starts}
            pos = 0
            for job in order:
                if job.id in started:
                    continue
                pos += 1
                code, msg = self.codes.get(job.id) or self.not_examined()
                if job.avoid_nodes:
                    msg += (f"; not on {', '.join(sorted(job.avoid_nodes))} for now: "
                            f"it could not start there a moment ago (dataset cache full)")
                self.plan.waiting[job.id] = Reason(code, msg, pos)
        return self.plan


def schedule(snapshot: Snapshot, topology: Topology | None = None) -> Plan:
    """Run one scheduling pass over `snapshot` and return what to do.

    `topology` is an optional `Topology.from_nodes(snapshot.nodes)` kept by a
    caller whose nodes do not change between passes (the simulator); without
    it the pass builds its own, which is always correct."""
    return _Pass(snapshot, topology).run()
