"""Invariants of a pass on random clusters, queues and quotas (hypothesis)."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.core import GPU, Allocation, Config, Job, Node, OrgQuota, ProjectQuota, Snapshot, schedule
from scheduler.core.ordering import las_queue_running, las_queue_waiting

NOW = 1_000_000.0
PROJECTS = ("alice", "bob", "charlie")
CODES = {"quota_project", "quota_org", "max_running", "time_limit", "budget", "gpu_type", "dependency",
         "array_throttle", "resources", "reservation", "priority", "preempting", "unplaceable", "sandbox", "fragmented"}
# SCHED_PROPERTY_EXAMPLES=2000 for a longer hunt; 120 keeps the suite fast.
SETTINGS = settings(max_examples=int(os.environ.get("SCHED_PROPERTY_EXAMPLES", "120")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def snapshots(draw, contended: bool = False) -> Snapshot:
    """Random pass inputs. `contended`: a busy cluster of mostly borrowed work
    and few admission refusals, so that preemption is exercised."""
    nodes, running, n_jobs = [], [], 0
    for i in range(draw(st.integers(1, 4))):
        name = f"n{i}"
        sandbox = "" if contended else draw(st.sampled_from(["", "docker", "docker", "kvm"]))
        gpus = [GPU(f"{name}-{k}", name, k, draw(st.sampled_from(["A", "B"])) if k == 0 else "A", 16000,
                    healthy=draw(st.booleans()) or draw(st.booleans()), shared=draw(st.booleans()),
                    load=draw(st.floats(0, 1)), sandbox=sandbox)
                for k in range(draw(st.integers(1, 8)))]
        nodes.append(Node(name, draw(st.sampled_from(["p1", "p2"])), gpus, schedulable=draw(st.integers(0, 5)) > 0))
        for g in gpus:  # some of what runs now; running work never overlaps (the DB guarantees it)
            use = draw(st.sampled_from(["whole", "whole", "frac", "free"] if contended else ["free", "free", "whole", "frac"]))
            if use == "free" or (use == "frac" and not g.shared):
                continue
            p = draw(st.sampled_from(PROJECTS[1:] if contended else PROJECTS))
            fracs = [1.0] if use == "whole" else draw(st.lists(st.sampled_from([0.2, 0.25, 0.5]), min_size=1, max_size=3))
            fracs = fracs if sum(fracs) <= 1 else fracs[:1]
            for f in fracs:
                n_jobs += 1
                j = Job(f"r{n_jobs}", p, f"org-{p}", p, f, NOW - 10_000, draw(st.sampled_from([600.0, 3600.0, 7200.0])),
                        qos=draw(st.integers(0, 2)), preemptible=draw(st.booleans()),
                        array_parent=draw(st.sampled_from([None, None, None, "arr"])), array_limit=2)
                running.append(Allocation(j, [g.id], NOW - draw(st.sampled_from([60.0, 5000.0, 5000.0])),
                                          {} if use == "whole" else {g.id: f}, borrowed=contended or draw(st.booleans())))
    queued = []
    for i in range(draw(st.integers(0, 14))):
        p = draw(st.sampled_from(PROJECTS))
        gpus = draw(st.sampled_from([0.0, 0.3, 0.5, 0.75, 1.0, 1.0, 2.0, 3.0, 4.0, 8.0, 12.0]))
        # Some whole-GPU jobs ask for several nodes (the spec allows only an even split).
        spans = [1, 1, 1] + [k for k in (2, 3, 4) if gpus >= k and gpus % k == 0]
        queued.append(Job(
            f"q{i}", p, f"org-{p}", p, gpus,
            NOW - draw(st.integers(0, 50_000)), draw(st.sampled_from([60.0, 1800.0, 3600.0, 36_000.0])),
            gpu_type=None if contended else draw(st.sampled_from([None, None, None, None, "A", "B", "C"])), gpu_memory_mb=draw(st.sampled_from([0, 0, 6000])),
            qos=draw(st.integers(0, 2)), preemptible=draw(st.booleans()),
            array_parent=draw(st.sampled_from([None, None, None, "arr"])), array_limit=2,
            deps_satisfied=contended or draw(st.integers(0, 12)) > 0, pool=draw(st.sampled_from([None, None, "p1"])),
            sandbox="docker" if contended else draw(st.sampled_from(["docker", "docker", "kvm"])),
            nodes=draw(st.sampled_from(spans)), attained_gpu_s=draw(st.sampled_from([0.0, 0.0, 1800.0, 20_000.0])),
            queued_since=NOW - draw(st.sampled_from([0.0, 600.0, 200_000.0]))))
    projects = {}
    for p in PROJECTS:
        g = 16.0 if contended and p == "alice" else draw(st.sampled_from([0.0, 2.0, 8.0, 16.0]))
        projects[p] = ProjectQuota(
            p, f"org-{p}", g, g + draw(st.sampled_from([0.0, 4.0, 64.0])),
            max_running_jobs=draw(st.sampled_from([None, 3, 10])), max_time_limit=draw(st.sampled_from([None, None, None, 7200.0])),
            gpu_hours_budget=None if contended else draw(st.sampled_from([None, 10.0])), gpu_hours_used=draw(st.sampled_from([0.0, 0.0, 0.0, 10.0])),
            allowed_gpu_types=draw(st.sampled_from([(), (), ("A",)])))
    orgs = {"org-alice": OrgQuota("org-alice", draw(st.sampled_from([None, 4.0, 100.0])))}
    cfg = Config(policy=draw(st.sampled_from(["fifo", "fifo-backfill", "multifactor", "las"])),
                 placement=draw(st.sampled_from(["bestfit", "spread"])), backfill=draw(st.booleans()),
                 preemption=draw(st.booleans()), max_reservations=draw(st.sampled_from([1, 2])))
    usage = {p: draw(st.floats(0, 1e6)) for p in PROJECTS}
    return Snapshot(NOW, nodes, running, queued, projects, orgs, usage, cfg)


def gpus_by_id(snap):
    return {g.id: (g, n) for n in snap.nodes for g in n.gpus}


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_no_gpu_is_ever_over_allocated(snap):
    plan = schedule(snap)
    whole: dict[str, int] = {}
    frac: dict[str, float] = {}
    for a in snap.running:
        for gid in a.gpu_ids:
            if a.fractions:
                frac[gid] = frac.get(gid, 0.0) + a.fractions[gid]
            else:
                whole[gid] = whole.get(gid, 0) + 1
    gpus = gpus_by_id(snap)
    for s in plan.starts:
        for gid in s.gpu_ids:
            g, node = gpus[gid]
            assert g.healthy and node.schedulable
            if s.fractions:
                assert g.shared
                frac[gid] = frac.get(gid, 0.0) + s.fractions[gid]
            else:
                whole[gid] = whole.get(gid, 0) + 1
    for gid, n in whole.items():
        assert n <= 1 and frac.get(gid, 0.0) == 0.0, gid
    for gid, f in frac.items():
        assert f <= 1.0 + 1e-9, gid


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_gangs_are_all_or_nothing_and_match_their_constraints(snap):
    plan = schedule(snap)
    jobs = {j.id: j for j in snap.queued}
    gpus = gpus_by_id(snap)
    for s in plan.starts:
        j = jobs[s.job_id]
        if j.gpus == 0:
            assert s.gpu_ids == []
        elif j.gpus < 1:
            assert len(s.gpu_ids) == 1 and s.fractions == {s.gpu_ids[0]: j.gpus}
        else:
            assert len(set(s.gpu_ids)) == len(s.gpu_ids) == int(j.gpus) and not s.fractions
        for gid in s.gpu_ids:
            g, node = gpus[gid]
            assert j.gpu_type is None or g.model == j.gpu_type
            assert j.pool is None or node.pool == j.pool
            assert g.sandbox in {"docker": ("", "docker", "process"), "kvm": ("kvm",)}[j.sandbox]
            allowed = snap.projects[j.project].allowed_gpu_types
            assert not allowed or g.model in allowed


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_quotas_and_borrowing_are_respected(snap):
    plan = schedule(snap)
    jobs = {j.id: j for j in snap.queued}
    used = {p: 0.0 for p in PROJECTS}
    count = {p: 0 for p in PROJECTS}
    org = 0.0
    arr = 0
    for a in snap.running:
        used[a.job.project] += a.job.gpus
        count[a.job.project] += 1
        org += a.job.gpus if a.job.org == "org-alice" else 0.0
        arr += a.job.array_parent == "arr"
    for s in plan.starts:  # in the order the pass started them
        j = jobs[s.job_id]
        q = snap.projects[j.project]
        assert j.deps_satisfied
        assert q.max_time_limit is None or j.time_limit <= q.max_time_limit
        assert j.gpus == 0 or q.gpu_hours_budget is None or q.gpu_hours_used < q.gpu_hours_budget
        assert s.borrowed == (j.gpus > 0 and used[j.project] + j.gpus > q.guaranteed_gpus + 1e-9)
        used[j.project] += j.gpus
        count[j.project] += 1
        assert j.gpus == 0 or used[j.project] <= q.max_gpus + 1e-9
        assert q.max_running_jobs is None or count[j.project] <= q.max_running_jobs
        if j.org == "org-alice" and j.gpus > 0 and snap.orgs["org-alice"].max_gpus is not None:
            org += j.gpus
            assert org <= snap.orgs["org-alice"].max_gpus + 1e-9
        if j.array_parent == "arr":
            arr += 1
            assert arr <= 2


def share_of(job: Job, gpu: GPU, fraction: float | None) -> float:
    """How much of `gpu` a job holds: 1 for a whole GPU, else its fraction or
    its memory share, whichever is larger."""
    if fraction is None:
        return 1.0
    return max(fraction, job.gpu_memory_mb / gpu.memory_mb if job.gpu_memory_mb else 0.0)


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_a_backfilled_job_never_delays_a_reservation(snap):
    """At a reservation's start its GPUs must have room for the job, counting
    everything still running then at its time limit, starts of this pass included."""
    plan = schedule(snap)
    jobs = {j.id: j for j in snap.queued}
    gpus = gpus_by_id(snap)
    preempted = {p.job_id for p in plan.preemptions}
    for r in plan.reservations:
        assert r.start_time >= snap.now
        job = jobs[r.job_id]
        for gid in r.gpu_ids:
            gpu = gpus[gid][0]
            held = 0.0
            for a in snap.running:
                end = snap.now if a.job.id in preempted else max(snap.now, a.start_time + a.job.time_limit)
                if gid in a.gpu_ids and end > r.start_time + 1e-6:
                    held += share_of(a.job, gpu, a.fractions.get(gid) if a.fractions else None)
            for s in plan.starts:
                if gid in s.gpu_ids and snap.now + jobs[s.job_id].time_limit > r.start_time + 1e-6:
                    held += share_of(jobs[s.job_id], gpu, s.fractions.get(gid) if s.fractions else None)
            need = share_of(job, gpu, job.gpus if job.gpus < 1 else None)
            assert held + need <= 1.0 + 1e-3, (r, gid, held, need)
    if not snap.config.backfill:
        assert plan.reservations == []
    assert len(plan.reservations) <= snap.config.max_reservations


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_only_eligible_victims_are_preempted(snap):
    plan = schedule(snap)
    if not snap.config.preemption:
        assert plan.preemptions == []
    running = {a.job.id: a for a in snap.running}
    jobs = {j.id: j for j in snap.queued}
    used = {p: sum(a.job.gpus for a in snap.running if a.job.project == p) for p in PROJECTS}
    assert len({p.job_id for p in plan.preemptions}) == len(plan.preemptions)
    for p in plan.preemptions:
        victim, by = running[p.job_id], jobs[p.by_job_id]
        assert snap.now - victim.start_time >= snap.config.min_runtime_s
        if snap.config.policy == "las" and las_queue_running(victim, snap.now, snap.config) > \
                las_queue_waiting(by, snap.now, snap.config):
            continue  # Tiresias' rule: more attained service than the job it makes room for
        assert (victim.borrowed and victim.job.project != by.project
                and used[victim.job.project] > snap.projects[victim.job.project].guaranteed_gpus) \
            or (victim.job.preemptible and victim.job.qos < by.qos)
        assert used[by.project] + by.gpus <= snap.projects[by.project].guaranteed_gpus + 1e-9
        assert plan.waiting[by.id].code == "preempting"
        assert by.id not in {s.job_id for s in plan.starts}


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_every_waiting_job_has_a_reason_and_a_position(snap):
    plan = schedule(snap)
    started = {s.job_id for s in plan.starts}
    waiting = [j for j in snap.queued if j.id not in started]
    assert set(plan.waiting) == {j.id for j in waiting}
    assert sorted(r.position for r in plan.waiting.values()) == list(range(1, len(waiting) + 1))
    for r in plan.waiting.values():
        assert r.code in CODES and r.message


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_a_job_without_nodes_above_one_is_always_placed_on_one_node(snap):
    plan = schedule(snap)
    jobs = {j.id: j for j in snap.queued}
    gpus = gpus_by_id(snap)
    for s in plan.starts:
        if jobs[s.job_id].nodes == 1:
            assert len({gpus[gid][1].name for gid in s.gpu_ids}) <= 1, s
    for r in plan.reservations:
        if jobs[r.job_id].nodes == 1:
            assert len({gpus[gid][1].name for gid in r.gpu_ids}) == 1, r


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_a_multi_node_job_gets_equal_gpus_on_exactly_its_nodes(snap):
    plan = schedule(snap)
    jobs = {j.id: j for j in snap.queued}
    gpus = gpus_by_id(snap)
    for s in list(plan.starts) + list(plan.reservations):
        j = jobs[s.job_id]
        if j.nodes > 1:
            per_node: dict[str, int] = {}
            for gid in s.gpu_ids:
                per_node[gpus[gid][1].name] = per_node.get(gpus[gid][1].name, 0) + 1
            assert len(per_node) == j.nodes and set(per_node.values()) == {int(j.gpus) // j.nodes}, s


@SETTINGS
@given(st.one_of(snapshots(), snapshots(contended=True)))
def test_fragmented_jobs_wait_although_enough_matching_gpus_are_free(snap):
    plan = schedule(snap)
    started = {s.job_id for s in plan.starts}
    jobs = {j.id: j for j in snap.queued}
    for job_id, free in plan.fragmented.items():
        assert job_id not in started and free >= jobs[job_id].gpus >= 1
        assert plan.waiting[job_id].code in {"fragmented", "preempting"}
    for job_id, r in plan.waiting.items():
        assert (r.code == "fragmented") <= (job_id in plan.fragmented)
