"""Free-capacity index of the cluster for one pass, and the placement rules.

GPUs are grouped in *classes* `(pool, model, memory_mb, shared, sandbox)`: a gang
never mixes classes, and a job's constraints (pool, gpu_type, gpu_memory_mb, sandbox, the
project's allowed types) select the classes it may use. Per class we keep, for
whole GPUs, each node's free GPU ids and the nodes bucketed by how many free
GPUs they have, so best fit is "the first non-empty bucket from g upwards"
instead of a scan of every node. Shared GPUs are bucketed by how many
thousandths of the GPU are still free, so packing a fraction is the same walk.

Fractions are counted in integer thousandths (UNITS) so that the fractions
placed on one GPU can never sum above 1.0 through float rounding.

Every job also takes its `cpus` and `memory_mb` on each of its nodes: `room`
holds what each node with a known size has left of them (less the system
reserve), and a node without room for a job is passed over as if its GPUs were
taken. CPU-only jobs go to the node with room that runs the fewest jobs.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from .model import GPU, Allocation, Job, Node

UNITS = 1000  # one whole GPU, in thousandths

ClassKey = tuple  # (pool, model, memory_mb, shared, sandbox)


def frac_units(job: Job, memory_mb: int) -> int:
    """Thousandths of a GPU of `memory_mb` a fractional job needs: its fraction,
    or its memory share when it asked for memory and that is larger. Above UNITS
    means it does not fit on such a GPU."""
    need = math.ceil(job.gpus * UNITS - 1e-6)
    if job.gpu_memory_mb and memory_mb > 0:
        need = max(need, math.ceil(job.gpu_memory_mb * UNITS / memory_mb - 1e-6))
    return max(need, 1)


def alloc_nodes(alloc: Allocation, node_of: dict[str, str]) -> list[str]:
    """The nodes a running job takes CPUs and memory on: its GPUs' nodes, or a CPU-only job's own."""
    if alloc.node is not None:
        return [alloc.node]
    return list(dict.fromkeys(node_of[g] for g in alloc.gpu_ids if g in node_of))


def fmt_cpus(x: float) -> str:
    return "no" if x <= 0 else f"{x:g}"


def fmt_mem(mb: float) -> str:
    return "no" if mb <= 0 else f"{mb / 1024:.3g} GiB" if mb >= 1024 else f"{int(mb)} MiB"


# How closely a set of GPUs of one node is linked: the tightest interconnect domain holding all of
# them (GPU.topo's levels, then none in common). Lower is better.
TOPO_LEVELS = ("nvlink", "pcie", "numa", "system")


def topo_level(gpus: list[GPU]) -> int | None:
    """Index in TOPO_LEVELS of the tightest domain holding every one of `gpus` (one node's), or None
    when they are fewer than two or one has no reported topology."""
    if len(gpus) < 2 or any(g.topo is None for g in gpus):
        return None
    for level in range(len(TOPO_LEVELS) - 1):
        first = gpus[0].topo[level]
        if first is not None and all(g.topo[level] == first for g in gpus):
            return level
    return len(TOPO_LEVELS) - 1


def topo_score(gpus: list[GPU]) -> int | None:
    """A placement's topology score: the worst `topo_level` over its nodes (None: not known)."""
    per_node: dict[str, list[GPU]] = {}
    for g in gpus:
        per_node.setdefault(g.node, []).append(g)
    levels = [lv for lv in (topo_level(gs) for gs in per_node.values()) if lv is not None]
    return max(levels) if levels else None


def alloc_units(alloc: Allocation, gpu: GPU) -> int:
    """Thousandths of `gpu` that a running allocation holds."""
    frac = alloc.fractions.get(gpu.id)
    if frac is None:
        return UNITS
    need = math.ceil(frac * UNITS - 1e-6)
    job = alloc.job
    if job.gpu_memory_mb and gpu.memory_mb > 0:
        need = max(need, math.ceil(job.gpu_memory_mb * UNITS / gpu.memory_mb - 1e-6))
    return min(max(need, 1), UNITS)


class Topology:
    """The static part of the index: which GPUs can take work and their
    classes. Built once per pass from the nodes, or once per replay by the
    simulator (`schedule(snapshot, topology=...)`), since it only changes when
    a node or GPU does."""

    def __init__(self, gpus: Iterable[tuple[GPU, str]]):
        self.gpu: dict[str, GPU] = {}
        self.cls_of: dict[str, ClassKey] = {}
        per_node: dict[tuple[ClassKey, str], list[GPU]] = {}
        for g, pool in gpus:
            cls = (pool, g.model, g.memory_mb, g.shared, g.sandbox)
            self.gpu[g.id] = g
            self.cls_of[g.id] = cls
            per_node.setdefault((cls, g.node), []).append(g)
        self.groups: list[tuple[ClassKey, str, list[str]]] = []
        self.node_size: dict[tuple[ClassKey, str], int] = {}
        self.capacity: dict[ClassKey, int] = {}
        self.max_node: dict[ClassKey, int] = {}
        for (cls, node), glist in per_node.items():
            glist.sort(key=lambda g: g.index)
            self.groups.append((cls, node, [g.id for g in glist]))
            self.node_size[(cls, node)] = len(glist)
            self.capacity[cls] = self.capacity.get(cls, 0) + len(glist)
            self.max_node[cls] = max(self.max_node.get(cls, 0), len(glist))
        # Node sizes per class, largest first: can a job of N nodes x G GPUs ever fit?
        self.sizes: dict[ClassKey, list[int]] = {}
        for (cls, _node), k in self.node_size.items():
            self.sizes.setdefault(cls, []).append(k)
        for lst in self.sizes.values():
            lst.sort(reverse=True)
        # Non-shared classes first so whole-GPU jobs leave shared GPUs to fractions.
        self.classes: list[ClassKey] = sorted(self.capacity, key=lambda c: (c[3], str(c[0]), c[1], c[2], c[4]))
        self.models: set[str] = {c[1] for c in self.classes}

    def fits(self, cls: ClassKey, per: int, nodes: int = 1) -> bool:
        """Could `nodes` nodes of this class hold `per` GPUs each, were they all free?"""
        sizes = self.sizes.get(cls, ())
        return len(sizes) >= nodes and sizes[nodes - 1] >= per

    @classmethod
    def from_nodes(cls, nodes: list[Node]) -> Topology:
        return cls((g, n.pool) for n in nodes if n.schedulable for g in n.gpus if g.healthy)


class ClusterState:
    """Mutable free-capacity index for one pass. Only healthy GPUs on
    schedulable nodes are indexed; anything else never appears as free.

    `used[gpu]` is thousandths in use (running work, starts of this pass and
    reservation holds). A GPU is *wholly free* at 0 and then sits in the
    per-node free lists; a shared GPU partly used sits in `rem_buckets` under
    the thousandths it has left."""

    def __init__(self, topo: Topology, used: dict[str, int]):
        self.topo = topo
        self.gpu = topo.gpu
        self.cls_of = topo.cls_of
        self.node_size = topo.node_size
        self.used = used
        self.held: set[str] = set()
        self.free: dict[ClassKey, dict[str, list[str]]] = {c: {} for c in topo.classes}
        self.buckets: dict[ClassKey, list[dict[str, None]]] = {
            c: [{} for _ in range(topo.max_node[c] + 1)] for c in topo.classes}
        self.total_free: dict[ClassKey, int] = {c: 0 for c in topo.classes}
        self.rem_buckets: dict[ClassKey, dict[int, dict[str, None]]] = {}
        self.classes = topo.classes
        # node -> [CPUs, MiB] still free for jobs; only nodes of a known size (index_nodes).
        self.room: dict[str, list[float]] = {}
        self.size: dict[str, tuple[float, float]] = {}  # the same, with nothing running
        self.jobs_on: dict[str, int] = {}  # active jobs per node: CPU-only jobs go to the least busy
        self.nodes: list[Node] = []
        # While set, placement takes only these nodes (dataset locality tries the nodes holding a
        # job's data first); None, as always outside that: any node.
        self.only: set[str] | None = None
        for cls, node, ids in topo.groups:
            free_ids = [i for i in ids if i not in used] if used else list(ids)
            self.free[cls][node] = free_ids
            if free_ids:
                self.buckets[cls][len(free_ids)][node] = None
                self.total_free[cls] += len(free_ids)
        for gid, u in used.items():
            if 0 < u < UNITS and self.gpu[gid].shared:
                cls = self.cls_of[gid]
                self.rem_buckets.setdefault(cls, {}).setdefault(UNITS - u, {})[gid] = None

    @classmethod
    def build(cls, nodes: list[Node], running: list[Allocation], topo: Topology | None = None,
              reserve: tuple[float, int] = (0.0, 0)) -> ClusterState:
        topo = topo or Topology.from_nodes(nodes)
        gpu = topo.gpu
        used: dict[str, int] = {}
        for a in running:
            if a.fractions:
                for gid in a.gpu_ids:
                    g = gpu.get(gid)
                    if g is not None:
                        used[gid] = min(UNITS, used.get(gid, 0) + alloc_units(a, g))
            else:
                for gid in a.gpu_ids:
                    if gid in gpu:
                        used[gid] = UNITS
        state = cls(topo, used)
        state.index_nodes(nodes, running, reserve)
        return state

    # -- node CPUs and memory ----------------------------------------------
    def index_nodes(self, nodes: list[Node], running: list[Allocation], reserve: tuple[float, int]) -> None:
        """Each node's CPUs and memory left for jobs: its size less `reserve` less what its running
        jobs take (a figure of 0 is not known: not accounted)."""
        self.nodes = nodes
        node_of = {g.id: n.name for n in nodes for g in n.gpus}
        for n in nodes:
            self.jobs_on[n.name] = 0
            if n.cpus > 0 or n.memory_mb > 0:
                self.size[n.name] = (n.cpus - reserve[0] if n.cpus > 0 else math.inf,
                                     n.memory_mb - reserve[1] if n.memory_mb > 0 else math.inf)
                self.room[n.name] = list(self.size[n.name])
        for a in running:
            self.take_room(alloc_nodes(a, node_of), a.job)

    def fits_room(self, node: str, job: Job | None) -> bool:
        if self.only is not None and node not in self.only:
            return False
        if job is not None and job.avoid_nodes and node in job.avoid_nodes:
            return False
        r = self.room.get(node) if job is not None else None
        return r is None or (r[0] + 1e-6 >= job.cpus and r[1] >= job.memory_mb)

    def take_room(self, nodes: Iterable[str], job: Job) -> None:
        for node in nodes:
            self.jobs_on[node] = self.jobs_on.get(node, 0) + 1
            r = self.room.get(node)
            if r is not None:
                r[0] -= job.cpus
                r[1] -= job.memory_mb

    def cpu_nodes(self, job: Job, hosts: tuple[str, ...]) -> list[Node]:
        """The nodes a CPU-only job may run on: schedulable, offering its sandbox, in its pool."""
        return [n for n in self.nodes if n.schedulable and n.sandbox in hosts
                and (job.pool is None or n.pool == job.pool)]

    def place_cpu(self, job: Job, hosts: tuple[str, ...]) -> str | None:
        """The node for a CPU-only job: of `cpu_nodes` those with room, the one running the fewest
        jobs (the caller's start takes its room)."""
        fits = [n.name for n in self.cpu_nodes(job, hosts) if self.fits_room(n.name, job)]
        return min(fits, key=lambda n: (self.jobs_on[n], n)) if fits else None

    def too_big(self, job: Job, nodes: Iterable[Node]) -> str | None:
        """Why `job` fits none of `nodes` even with nothing running there (their size less the
        reserve), or None when one could hold it or a size is not known."""
        sizes = [self.size.get(n.name) for n in nodes]
        if not sizes or None in sizes or (job.cpus <= 0 and job.memory_mb <= 0):
            return None
        if any(c + 1e-6 >= job.cpus and m >= job.memory_mb for c, m in sizes):
            return None
        c, m = max(sizes)
        return f"the largest has {fmt_cpus(c)} CPUs and {fmt_mem(m)} of memory for jobs"

    # -- queries ---------------------------------------------------------
    def free_units(self, gid: str) -> int:
        return UNITS - self.used.get(gid, 0)

    def free_whole_total(self) -> int:
        return sum(self.total_free.values())

    def has_shared_room(self) -> bool:
        if any(self.total_free[c] for c in self.classes if c[3]):
            return True
        return any(bk for bk in self.rem_buckets.values())

    def free_count(self, classes: list[ClassKey]) -> int:
        return sum(self.total_free.get(c, 0) for c in classes)

    def node_load(self, cls: ClassKey, node: str) -> tuple[int, float]:
        """(GPUs in use, mean load hint) of a node within a class: spread's key."""
        ids = self.free[cls][node]
        used = self.node_size[(cls, node)] - len(ids)
        load = sum(self.gpu[i].load for i in ids) / len(ids) if ids else 1.0
        return used, load

    # -- index maintenance ----------------------------------------------
    def _drop_whole(self, gid: str) -> None:
        cls = self.cls_of[gid]
        node = self.gpu[gid].node
        ids = self.free[cls][node]
        k = len(ids)
        ids.remove(gid)
        b = self.buckets[cls]
        del b[k][node]
        if k > 1:
            b[k - 1][node] = None
        self.total_free[cls] -= 1

    def _add_whole(self, gid: str) -> None:
        cls = self.cls_of[gid]
        g = self.gpu[gid]
        ids = self.free[cls][g.node]
        k = len(ids)
        ids.append(gid)
        ids.sort(key=lambda i: self.gpu[i].index)
        b = self.buckets[cls]
        if k:
            del b[k][g.node]
        b[k + 1][g.node] = None
        self.total_free[cls] += 1

    def _set_used(self, gid: str, old: int, new: int) -> None:
        """Move a GPU between the whole-free lists and the partial buckets."""
        if old == 0 and new > 0:
            self._drop_whole(gid)
        elif old > 0 and new == 0:
            self._add_whole(gid)
        if self.gpu[gid].shared:
            rb = self.rem_buckets.setdefault(self.cls_of[gid], {})
            if 0 < old < UNITS:
                d = rb[UNITS - old]
                del d[gid]
                if not d:
                    del rb[UNITS - old]
            if 0 < new < UNITS:
                rb.setdefault(UNITS - new, {})[gid] = None
        if new:
            self.used[gid] = new
        else:
            self.used.pop(gid, None)

    def untake(self, gid: str, units: int = UNITS) -> None:
        """Give back what `take` took (a placement the pass decided not to start after all)."""
        old = self.used.get(gid, 0)
        self._set_used(gid, old, old - units)

    def take(self, gid: str, units: int = UNITS) -> None:
        """Mark `units` of a GPU as used (UNITS = the whole GPU)."""
        old = self.used.get(gid, 0)
        self._set_used(gid, old, old + units)

    def hold(self, gid: str) -> int:
        """Take a GPU out of the free index for a reservation; returns the
        thousandths that were free so `unhold` can put them back."""
        if gid in self.held or gid not in self.gpu:
            return 0
        r = self.free_units(gid)
        if r > 0:
            self.take(gid, r)
        self.held.add(gid)
        return r

    def unhold(self, gid: str, units: int) -> None:
        self.held.discard(gid)
        if units > 0:
            old = self.used.get(gid, 0)
            self._set_used(gid, old, old - units)

    # -- placement --------------------------------------------------------
    def place_whole(self, g: int, classes: list[ClassKey], mode: str, nodes: int = 1,
                    job: Job | None = None) -> list[str] | None:
        """All-or-nothing placement of `g` whole GPUs on exactly `nodes` nodes of one
        class, `g // nodes` on each; a single-node job is never split. Best fit takes
        the nodes left with the least over, spread the least used then the coolest.
        Only nodes with room for `job`'s CPUs and memory. Takes the GPUs and returns
        them, the first node's first (the gang's master)."""
        if nodes > 1:
            return self._place_gang(g // nodes, nodes, classes, mode, job)
        best = None  # (score, cls, node)
        for cls in classes:
            if self.total_free[cls] < g:
                continue
            b = self.buckets[cls]
            if mode == "spread":
                for k in range(g, len(b)):
                    for node in b[k]:
                        score = self.node_load(cls, node)
                        if (best is None or score < best[0]) and self.fits_room(node, job):
                            best = (score, cls, node)
            else:
                for k in range(g, len(b)):
                    node = next((n for n in b[k] if self.fits_room(n, job)), None)
                    if node is not None:
                        if best is None or k - g < best[0]:
                            best = (k - g, cls, node)
                        break
        if best is None:
            return None
        _, cls, node = best
        return self._take_on_node(cls, node, g, mode)

    def _place_gang(self, per: int, nodes: int, classes: list[ClassKey], mode: str,
                    job: Job | None = None) -> list[str] | None:
        best = None  # (score, cls, [node, ...])
        for cls in classes:
            if self.total_free[cls] < per * nodes:
                continue
            b = self.buckets[cls]
            if mode == "spread":
                cands = sorted((self.node_load(cls, n), n) for k in range(per, len(b)) for n in b[k]
                               if self.fits_room(n, job))
                if len(cands) < nodes:
                    continue
                chosen = cands[:nodes]
                score = (sum(c[0][0] for c in chosen), sum(c[0][1] for c in chosen))
                picked = [n for _, n in chosen]
            else:
                picked, score = [], 0
                for k in range(per, len(b)):
                    for n in b[k]:
                        if not self.fits_room(n, job):
                            continue
                        picked.append(n)
                        score += k - per
                        if len(picked) == nodes:
                            break
                    if len(picked) == nodes:
                        break
                if len(picked) < nodes:
                    continue
            if best is None or score < best[0]:
                best = (score, cls, picked)
        if best is None:
            return None
        _, cls, picked = best
        out: list[str] = []
        for node in picked:
            out += self._take_on_node(cls, node, per, mode)
        return out

    def fragmented_free(self, job: Job, classes: list[ClassKey]) -> int:
        """After `job` failed to place: the free GPUs of its best class when they would be
        enough if it were split differently (0 when simply too few are free)."""
        if job.gpus < 1:
            return 0
        g = int(job.gpus)
        free = max((self.total_free.get(c, 0) for c in classes), default=0)
        return free if free >= g else 0

    def _best_linked(self, ids: list[str], k: int) -> list[str]:
        """Of a node's free GPUs, those of the tightest domain (TOPO_LEVELS) that has `k` of them
        free, the one with the fewest free first (best fit: larger domains stay whole for larger
        jobs); all of them when the probe reported no topology."""
        gpu = self.gpu
        if k < 2 or len(ids) <= k or any(gpu[i].topo is None for i in ids):
            return ids
        for level in range(len(TOPO_LEVELS) - 1):
            domains: dict[object, list[str]] = {}
            for i in ids:
                d = gpu[i].topo[level]
                if d is not None:
                    domains.setdefault(d, []).append(i)
            fits = [m for m in domains.values() if len(m) >= k]
            if fits:
                return min(fits, key=lambda m: (len(m), gpu[m[0]].index))
        return ids

    def _take_on_node(self, cls: ClassKey, node: str, k: int, mode: str) -> list[str]:
        ids = self._best_linked(self.free[cls][node], k)
        if mode == "spread":
            chosen = sorted(ids, key=lambda i: (self.gpu[i].load, self.gpu[i].index))[:k]
        else:
            chosen = ids[:k]
        for gid in chosen:
            self.take(gid)
        return chosen

    def _free_nodes(self, cls: ClassKey, job: Job, most_first: bool):
        """(wholly free GPUs, node) of a class's nodes with room for `job`, by that count."""
        b = self.buckets[cls]
        for k in (range(len(b) - 1, 0, -1) if most_first else range(1, len(b))):
            for n in b[k]:
                if self.fits_room(n, job):
                    yield k, n

    def place_fraction(self, job: Job, classes: list[ClassKey], mode: str) -> tuple[str, int] | None:
        """Pack a fractional job on one shared GPU. Best fit: the partly used
        GPU left with the least room, else a wholly free one on the busiest
        node. Spread: a wholly free GPU on the least used node, else the partly
        used GPU with the most room. Returns (gpu_id, units)."""
        best = None  # (score, gid, units)
        for cls in classes:
            if not cls[3]:
                continue
            need = frac_units(job, cls[2])
            if need > UNITS:
                continue
            rb = self.rem_buckets.get(cls) or {}
            cand = None
            room = ((lambda gid: self.fits_room(self.gpu[gid].node, job))
                    if self.room or self.only is not None or job.avoid_nodes
                    else (lambda gid: True))
            whole = self._free_nodes(cls, job, most_first=mode == "spread")
            if mode == "spread":
                k_node = next(whole, None)
                if k_node is not None:
                    cand = (-(k_node[0] + 1) * UNITS, self.free[cls][k_node[1]][0])
                else:
                    for top in sorted((u for u in rb if u >= need and rb[u]), reverse=True):
                        gid = next((i for i in rb[top] if room(i)), None)
                        if gid is not None:
                            cand = (-top, gid)
                            break
            else:
                for u in range(need, UNITS):
                    gid = next((i for i in rb.get(u) or () if room(i)), None)
                    if gid is not None:
                        cand = (u - need, gid)
                        break
                k_node = next(whole, None) if cand is None else None
                if k_node is not None:
                    cand = (UNITS - need + k_node[0], self.free[cls][k_node[1]][0])
            if cand is not None and (best is None or cand[0] < best[0]):
                best = (cand[0], cand[1], need)
        if best is None:
            return None
        _, gid, need = best
        self.take(gid, need)
        return gid, need
