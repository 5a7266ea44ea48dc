"""EASY backfill: a reservation for the highest-priority blocked job.

The reservation is computed from when running jobs must end at the latest
(start_time + time_limit), so it is a bound, not a forecast: jobs that end
early only bring it forward. The reserved GPUs that are free now are *held*
(taken out of the free index); a later job may use them only when it will end
(now + time_limit) before the reservation starts, so backfill never delays it.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .model import Allocation, Job, Reservation
from .placement import UNITS, ClassKey, ClusterState, Topology, alloc_units, frac_units


@dataclass
class Held:
    """A reservation and the free thousandths of each GPU it holds now."""

    res: Reservation
    held: dict[str, int] = field(default_factory=dict)
    classes: dict[ClassKey, int] = field(default_factory=dict)  # wholly held GPUs per class

    def recount(self, state: ClusterState) -> None:
        self.classes = {}
        for gid, u in self.held.items():
            if u == UNITS:
                cls = state.cls_of[gid]
                self.classes[cls] = self.classes.get(cls, 0) + 1


def release_timeline(state: ClusterState, running: list[Allocation], now: float,
                     ending_now: list[Allocation] = ()) -> Iterator[tuple[float, list[tuple[str, int]]]]:
    """(latest end, [(gpu_id, thousandths)]) of running allocations on indexed
    GPUs, soonest first, those ending at the same time merged. Overdue jobs and
    `ending_now` (preempted in this pass) count as ending now. Lazy, through a
    heap, because a reservation usually needs only the first few ends."""
    heap = [(now, i, a) for i, a in enumerate(ending_now)]
    base = len(heap)
    heap += [(max(now, a.start_time + a.job.time_limit), base + i, a) for i, a in enumerate(running)]
    heapq.heapify(heap)
    gpu = state.gpu
    end, items = None, []
    while heap:
        t, _, a = heapq.heappop(heap)
        if end is not None and t != end and items:
            yield end, items
            items = []
        end = t
        if a.fractions:
            items += [(gid, alloc_units(a, gpu[gid])) for gid in a.gpu_ids if gid in gpu]
        else:
            items += [(gid, UNITS) for gid in a.gpu_ids if gid in gpu]
    if items:
        yield end, items


def earliest_start(state: ClusterState, job: Job, classes: list[ClassKey], mode: str,
                   timeline: Iterable[tuple[float, list[tuple[str, int]]]]) -> tuple[float, list[str]] | None:
    """When and where `job` could start if running jobs end at their limits.
    GPUs held by earlier reservations are left out. None if never."""
    wanted = set(classes)
    hyp: dict[str, int] = {}
    if job.gpus >= 1:
        g, per, nodes = int(job.gpus), job.gpus_per_node, job.nodes
        # Per class: free GPUs per node by then, and how many nodes have `per` of them;
        # a placement is tried only once enough nodes do (a single-node job never splits).
        on_node = {c: {n: len(ids) for n, ids in state.free[c].items()} for c in classes}
        ready = {c: sum(1 for k in on_node[c].values() if k >= per) for c in classes}
        freed: dict[ClassKey, list[str]] = {c: [] for c in classes}
        for end, items in timeline:
            for gid, u in items:
                cls = state.cls_of[gid]
                if cls not in wanted or gid in state.held:
                    continue
                before = hyp.get(gid, state.free_units(gid))
                after = min(UNITS, before + u)
                hyp[gid] = after
                if after == UNITS and before < UNITS:
                    freed[cls].append(gid)
                    node = state.gpu[gid].node
                    k = on_node[cls][node] = on_node[cls].get(node, 0) + 1
                    ready[cls] += k == per
            for cls in classes:
                if ready[cls] >= nodes:
                    ids = [i for node_ids in state.free[cls].values() for i in node_ids] + freed[cls]
                    temp = ClusterState(Topology((state.gpu[i], cls[0]) for i in ids), {})
                    chosen = temp.place_whole(g, [cls], mode, nodes)
                    if chosen:
                        return end, chosen
        return None
    need = {c: frac_units(job, c[2]) for c in classes if c[3]}
    for end, items in timeline:
        touched = []
        for gid, u in items:
            cls = state.cls_of[gid]
            if cls not in need or gid in state.held:
                continue
            hyp[gid] = min(UNITS, hyp.get(gid, state.free_units(gid)) + u)
            touched.append(gid)
        # Only GPUs touched at this time can have started to fit.
        fits = [(hyp[gid] - need[state.cls_of[gid]], gid) for gid in touched
                if hyp[gid] >= need[state.cls_of[gid]]]
        if fits:
            return end, [min(fits)[1]]  # best fit among those free by then
    return None


def reserve(state: ClusterState, job: Job, start_time: float, gpu_ids: list[str]) -> Held:
    h = Held(Reservation(job.id, start_time, list(gpu_ids)))
    for gid in gpu_ids:
        h.held[gid] = state.hold(gid)
    h.recount(state)
    return h


def could_use(h: Held, state: ClusterState, job: Job, classes: list[ClassKey]) -> bool:
    """Cheap test before un-holding: might the reservation's GPUs make `job` fit?"""
    if not h.held:
        return False
    if job.gpus >= 1:
        g = int(job.gpus)
        return any(state.total_free.get(c, 0) + h.classes.get(c, 0) >= g for c in classes)
    return any(state.cls_of[gid] in classes and u > 0 for gid, u in h.held.items())


def with_released(state: ClusterState, helds: list[Held], place):
    """Run `place()` with the given reservations' GPUs back in the free index,
    then hold again whatever it did not take."""
    for h in helds:
        for gid, u in h.held.items():
            state.unhold(gid, u)
    try:
        return place()
    finally:
        for h in helds:
            for gid in h.held:
                h.held[gid] = state.hold(gid)
            h.recount(state)
