"""The autoscaler: one tick (Celery beat, `autoscale.tick`, every AUTOSCALE_INTERVAL_S) per the steps below.

1. Reconcile: booting nodes whose agent registered (and answered its queue probe) turn ready;
   booting nodes past the pool's boot timeout are deleted (the shape backs off); ready nodes
   the reaper marked down are deleted; releases the provider failed are retried.
2. Plan: a read-only scheduling plan of the current snapshot, then `scheduler.core.autoscale`
   (the same function the simulator runs) says what to add and what to release.
3. Scale up: node rows (with their agent tokens) first, then the provider creates the machines;
   a node the provider could not create is marked failed and the pool backs off.
4. Scale down: each idle node is drained under the scheduling lock after checking, inside that
   lock, that it holds no job, so no pass can place a job on it once it is chosen; then the
   provider deletes it and the node row goes `down` with its token cleared.

Every step writes a ScaleEvent with its reason and an audit row.
"""
from __future__ import annotations

import logging
import statistics
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import F, Max, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from portal.core import locks
from portal.core.context import Actor
from portal.core.errors import ServiceError
from portal.core.services import audit_record
from portal.jobs.models import HOLDING, Allocation, Job
from portal.jobs.selectors import gpu_hours_used_this_month
from portal.jobs.services import job_move
from portal.nodes.models import Node, NodeState
from portal.nodes.services import node_add, parse_gpu_spec
from portal.tenancy.models import Quota
from scheduler import core
from scheduler.adapter import build_snapshot
from scheduler.core.autoscale import PoolNode as CoreNode, PoolSpec, autoscale

from .models import NodePool, PoolNode, PoolNodeState, ScaleEvent
from .providers import NodeRequest, ProviderError, provider_for

log = logging.getLogger(__name__)
ACTOR = Actor(user=None, label="autoscaler")
NOTES_KEY = "autoscale:notes"
LIVE = [PoolNodeState.BOOTING, PoolNodeState.READY, PoolNodeState.RELEASING]
RELEASED_REASON = "released by the autoscaler"
MAX_BACKOFF_S = 3600


def _event(pool: NodePool, kind: str, reason: str, *, nodes=(), delta=0, demand=0.0, now=None) -> ScaleEvent:
    size = PoolNode.objects.filter(pool=pool, state__in=[PoolNodeState.BOOTING, PoolNodeState.READY]).count()
    ev = ScaleEvent.objects.create(pool=pool, at=now or timezone.now(), kind=kind, nodes=list(nodes), delta=delta,
                                   size_after=size, demand_gpus=round(demand, 3), reason=reason[:500])
    audit_record(actor=ACTOR, action=f"autoscale.{kind}", obj=pool, nodes=list(nodes), reason=reason[:500])
    log.info("pool %s: %s %s: %s", pool.name, kind, ",".join(nodes), reason)
    return ev


def _backoff(pool: NodePool, reason: str, now) -> None:
    """The shape is unavailable for backoff_s, doubled by each failure in a row (an hour at most)."""
    with transaction.atomic():
        pool = NodePool.objects.select_for_update().get(pk=pool.pk)
        wait = min(pool.backoff_s * 2 ** pool.failures, MAX_BACKOFF_S)
        pool.failures += 1
        pool.unavailable_until = now + timedelta(seconds=wait)
        pool.unavailable_reason = reason[:300]
        pool.save(update_fields=["failures", "unavailable_until", "unavailable_reason"])
        _event(pool, ScaleEvent.Kind.UNAVAILABLE, f"no new node for {wait} s: {reason}", now=now)


def _retire_node_row(pool_node: PoolNode, reason: str) -> None:
    """The node row of a deleted machine: down, with no token, so nothing can bring it back."""
    if pool_node.node_id:
        Node.objects.filter(pk=pool_node.node_id).update(state=NodeState.DOWN, state_reason=reason[:200],
                                                         token_digest="")


def _delete(pool_node: PoolNode, *, final_state: str, reason: str, now) -> bool:
    """Ask the provider to delete the machine; on success the node is no longer paid for."""
    pool = pool_node.pool
    try:
        provider_for(pool).delete(pool_node.name, pool_node.provider_id)
    except (ProviderError, ValueError) as exc:
        with transaction.atomic():
            _event(pool, ScaleEvent.Kind.PROVIDER_ERROR, f"could not delete {pool_node.name}: {exc}",
                   nodes=[pool_node.name], now=now)
        return False
    with transaction.atomic():
        PoolNode.objects.filter(pk=pool_node.pk).update(state=final_state, released_at=now, reason=reason[:300])
        _retire_node_row(pool_node, RELEASED_REASON if final_state == PoolNodeState.RELEASED else reason)
        if final_state == PoolNodeState.RELEASED:
            _event(pool, ScaleEvent.Kind.RELEASED, reason, nodes=[pool_node.name], delta=-1, now=now)
    return True


def _node_busy(node_id: int) -> bool:
    return (Job.objects.filter(state__in=HOLDING, node_id=node_id).exists()
            or Allocation.objects.filter(gpu__node_id=node_id, released_at__isnull=True).exists())


def reconcile(now) -> dict:
    """Step 1: registrations, boot timeouts, nodes gone down, unfinished releases."""
    out = {"registered": 0, "boot_timeout": 0, "down": 0, "released": 0}
    timed_out: dict[int, tuple] = {}
    for pn in PoolNode.objects.filter(state=PoolNodeState.BOOTING).select_related("pool", "node"):
        node = pn.node
        if node is not None and node.state == NodeState.READY and node.queue_verified_at is not None:
            with transaction.atomic():
                if PoolNode.objects.filter(pk=pn.pk, state=PoolNodeState.BOOTING).update(
                        state=PoolNodeState.READY, registered_at=node.queue_verified_at, jobs=[]):
                    NodePool.objects.filter(pk=pn.pool_id).update(failures=0)
                    boot = (node.queue_verified_at - pn.created_at).total_seconds()
                    _event(pn.pool, ScaleEvent.Kind.REGISTERED, f"agent registered after {boot:.0f} s",
                           nodes=[pn.name], now=now)
                    out["registered"] += 1
        elif (now - pn.created_at).total_seconds() > pn.pool.boot_timeout_s:
            why = (f"its agent did not register within the boot timeout of {pn.pool.boot_timeout_s} s"
                   + (f" ({node.waiting_for})" if node is not None and node.waiting_for else ""))
            with transaction.atomic():
                if not PoolNode.objects.filter(pk=pn.pk, state=PoolNodeState.BOOTING).update(
                        state=PoolNodeState.RELEASING, release_started_at=now, reason=why[:300]):
                    continue
                _event(pn.pool, ScaleEvent.Kind.BOOT_TIMEOUT, f"deleting {pn.name}: {why}", nodes=[pn.name], delta=-1,
                       now=now)
            pn.refresh_from_db()
            _delete(pn, final_state=PoolNodeState.FAILED, reason=why, now=now)
            timed_out.setdefault(pn.pool_id, (pn.pool, []))[1].append(pn.name)
            out["boot_timeout"] += 1
    for pool, names in timed_out.values():  # one back-off per pool and tick, however many timed out
        _backoff(pool, f"node {', '.join(names)} never registered", now)
    for pn in PoolNode.objects.filter(state=PoolNodeState.READY, node__state=NodeState.DOWN).select_related("pool"):
        why = f"node {pn.name} went down ({pn.node.state_reason if pn.node else 'gone'}): deleting it"
        with transaction.atomic():
            if not PoolNode.objects.filter(pk=pn.pk, state=PoolNodeState.READY).update(
                    state=PoolNodeState.RELEASING, release_started_at=now, reason=why[:300]):
                continue
        pn.refresh_from_db()
        out["down"] += _delete(pn, final_state=PoolNodeState.FAILED, reason=why, now=now)
    retry_after = now - timedelta(seconds=settings.AUTOSCALE_INTERVAL_S)
    for pn in PoolNode.objects.filter(state=PoolNodeState.RELEASING, release_started_at__lt=retry_after,
                                      ).select_related("pool"):
        if pn.node_id and _node_busy(pn.node_id):
            continue  # drained by hand with a job still on it: it ends first
        out["released"] += _delete(pn, final_state=PoolNodeState.RELEASED, reason=pn.reason or "idle", now=now)
    return out


def boot_estimates_s(pools) -> dict[int, float]:
    """How long each pool's nodes took to register lately (median of its last 10), else a guess;
    by pool id, in one query whatever the number of pools."""
    pools = list(pools)
    took: dict[int, list[float]] = {p.pk: [] for p in pools}
    for pool_id, created, registered in (
            PoolNode.objects.filter(pool__in=pools, registered_at__isnull=False)
            .annotate(n=Window(RowNumber(), partition_by=[F("pool_id")], order_by=F("registered_at").desc()))
            .filter(n__lte=10).values_list("pool_id", "created_at", "registered_at")):
        took[pool_id].append((registered - created).total_seconds())
    return {p.pk: statistics.median(took[p.pk]) if took[p.pk] else float(min(p.boot_timeout_s, 120))
            for p in pools}


def pool_specs(pools, now) -> list:
    """The scheduler's PoolSpec of each pool (one query for their boot estimates)."""
    pools = list(pools)
    boots = boot_estimates_s(pools)
    return [_spec(p, now, boots[p.pk]) for p in pools]


def _spec(pool: NodePool, now, boot_s: float):
    available = pool.unavailable_until is None or pool.unavailable_until <= now
    note = "" if available else (f"pool {pool.name} is unavailable until "
                                 f"{pool.unavailable_until:%H:%M:%S} UTC ({pool.unavailable_reason})")
    return PoolSpec(
        name=pool.name, gpu_model=pool.gpu_model, gpus_per_node=pool.gpus_per_node,
        price_per_gpu_hour=float(pool.price_per_gpu_hour), gpu_memory_mb=_model_memory_mb(pool.gpu_model),
        min_nodes=pool.min_nodes, max_nodes=pool.max_nodes, max_per_step=pool.max_per_step,
        idle_release_s=pool.idle_release_s, boot_estimate_s=boot_s,
        max_concurrent_releases=pool.max_concurrent_releases,
        max_cost_per_hour=float(pool.max_cost_per_hour) if pool.max_cost_per_hour is not None else None,
        sandbox=pool.sandbox, available=available, unavailable_note=note)


def _model_memory_mb(model: str) -> int:
    try:
        return parse_gpu_spec(f"1x{model}")[2]
    except ServiceError:
        return 0


def _pool_nodes(now) -> list:
    """The live pool nodes as the core sees them, with each ready node's idle time."""
    rows = list(PoolNode.objects.filter(state__in=LIVE, pool__enabled=True).select_related("pool", "node"))
    ready_ids = [pn.node_id for pn in rows if pn.state == PoolNodeState.READY and pn.node_id]
    busy = set(Job.objects.filter(node_id__in=ready_ids, state__in=HOLDING).values_list("node_id", flat=True))
    busy |= set(Allocation.objects.filter(gpu__node_id__in=ready_ids, released_at__isnull=True)
                .values_list("gpu__node_id", flat=True))
    last_alloc = dict(Allocation.objects.filter(gpu__node_id__in=ready_ids).values("gpu__node_id")
                      .annotate(t=Max("released_at")).values_list("gpu__node_id", "t"))
    last_job = dict(Job.objects.filter(node_id__in=ready_ids).values("node_id").annotate(t=Max("ended_at"))
                    .values_list("node_id", "t"))
    out = []
    for pn in rows:
        idle_since = None
        if pn.state == PoolNodeState.READY and pn.node_id and pn.node_id not in busy \
                and pn.node is not None and pn.node.state == NodeState.READY:
            times = [t for t in (pn.registered_at, last_alloc.get(pn.node_id), last_job.get(pn.node_id)) if t]
            idle_since = max(times).timestamp() if times else now.timestamp()
        out.append(CoreNode(name=pn.name, pool=pn.pool.name, state=pn.state, created_at=pn.created_at.timestamp(),
                            idle_since=idle_since, jobs=[str(j) for j in pn.jobs or []]))
    return out


def _budgets(project_slugs, now) -> dict[str, float | None]:
    """Remaining GPU-hours this month per project with a budget."""
    quotas = list(Quota.objects.filter(project__slug__in=project_slugs, gpu_hours_budget__isnull=False)
                  .values_list("project_id", "project__slug", "gpu_hours_budget"))
    used = gpu_hours_used_this_month([q[0] for q in quotas], now)
    return {slug: float(budget) - used.get(pid, 0.0) for pid, slug, budget in quotas}


def scale_up(pool: NodePool, count: int, jobs: list[list[str]], *, reason: str, demand: float, now) -> list[str]:
    """Create `count` nodes in the pool: their rows and tokens, then the machines. Returns the names created."""
    requests, secrets_by_name = [], {}
    with transaction.atomic():
        pool = NodePool.objects.select_for_update().get(pk=pool.pk)
        start = pool.next_index
        pool.next_index += count
        pool.save(update_fields=["next_index"])
        for i in range(count):
            name = f"{pool.name}-{start + i}"
            node, secret = node_add(actor=ACTOR, name=name, gpus=f"{pool.gpus_per_node}x{pool.gpu_model}",
                                    pool=pool.name)
            # Not schedulable until its own agent registers and answers its queue probe.
            Node.objects.filter(pk=node.pk).update(queue_verified_at=None, queue_probe="", agent_registered_at=None)
            PoolNode.objects.create(pool=pool, name=name, node=node, gpus=pool.gpus_per_node,
                                    price_per_gpu_hour=pool.price_per_gpu_hour, created_at=now,
                                    jobs=[int(j) for j in (jobs[i] if i < len(jobs) else [])])
            requests.append(NodeRequest(name=name, token=secret, pool=pool.name, gpu_model=pool.gpu_model,
                                        gpus=pool.gpus_per_node, sandbox=pool.sandbox))
            secrets_by_name[name] = secret
        _event(pool, ScaleEvent.Kind.SCALE_UP, reason, nodes=[r.name for r in requests], delta=count, demand=demand,
               now=now)
    try:
        results = provider_for(pool).create(requests)
    except Exception as exc:  # a provider bug must not leave nodes booting forever: they fail here
        log.exception("pool %s: provider create failed", pool.name)
        results = {r.name: ProviderError(f"{type(exc).__name__}: {exc}") for r in requests}
    created, failed, unavailable = [], [], False
    for r in requests:
        result = results.get(r.name, ProviderError("the provider did not say"))
        if isinstance(result, Exception):
            failed.append(f"{r.name}: {result}")
            unavailable = unavailable or getattr(result, "unavailable", False)
            with transaction.atomic():
                pn = PoolNode.objects.get(name=r.name)
                PoolNode.objects.filter(pk=pn.pk).update(state=PoolNodeState.FAILED, released_at=now,
                                                         reason=str(result)[:300], jobs=[])
                _retire_node_row(pn, f"the provider could not create it: {result}")
                _event(pool, ScaleEvent.Kind.PROVIDER_ERROR, f"could not create {r.name}: {result}", nodes=[r.name],
                       delta=-1, now=now)
        else:
            PoolNode.objects.filter(name=r.name).update(provider_id=str(result or "")[:200])
            created.append(r.name)
    if failed:
        what = "out of stock" if unavailable else "create failed"
        _backoff(pool, f"{what} for {len(failed)} of {len(requests)} nodes ({failed[0]})", now)
    return created


def release(name: str, *, reason: str, now) -> bool:
    """Drain an idle pool node and have the provider delete it. Never one holding a job: the check
    and the drain happen under the scheduling pass's lock, so a pass either placed its job before
    (the node is busy, kept) or sees it drained (it places nothing there)."""
    with transaction.atomic():
        locks.xact_lock(locks.SCHEDULE_PASS)
        pn = PoolNode.objects.select_for_update().filter(name=name, state=PoolNodeState.READY).select_related(
            "pool").first()
        if pn is None or pn.node_id is None or _node_busy(pn.node_id):
            return False
        if not Node.objects.filter(pk=pn.node_id, state=NodeState.READY).update(
                state=NodeState.DRAINED, state_reason=f"autoscaler: {reason}"[:200]):
            return False
        PoolNode.objects.filter(pk=pn.pk).update(state=PoolNodeState.RELEASING, release_started_at=now,
                                                 reason=reason[:300])
        audit_record(actor=ACTOR, action="node.drain", obj=pn.node, reason=f"autoscaler: {reason}")
        _event(pn.pool, ScaleEvent.Kind.RELEASE, f"draining {name} to release it: {reason}", nodes=[name], now=now)
    pn.refresh_from_db()
    return _delete(pn, final_state=PoolNodeState.RELEASED, reason=reason, now=now)


def _movable() -> set[str]:
    """Running jobs the autoscaler may move to consolidate: they checkpoint, and are not do-not-disrupt."""
    return {str(j) for j in Job.objects.filter(state__in=HOLDING, do_not_disrupt=False)
            .exclude(checkpoint_signal="").values_list("pk", flat=True)}


def consolidate(name: str, job_ids: list[str], *, now) -> bool:
    """Move the checkpointing jobs off a lightly used node so it can be released: drain it (under the
    scheduling lock, after checking it holds exactly these jobs, each still movable), then move
    each job (it saves its checkpoint and resumes on another node of the pool). The node is deleted
    by a later tick once empty, as any release."""
    wanted = {int(j) for j in job_ids}
    with transaction.atomic():
        locks.xact_lock(locks.SCHEDULE_PASS)
        pn = PoolNode.objects.select_for_update().filter(name=name, state=PoolNodeState.READY).select_related(
            "pool").first()
        if pn is None or pn.node_id is None:
            return False
        holding = Job.objects.filter(state__in=HOLDING, node_id=pn.node_id)
        held = set(holding.values_list("pk", flat=True))
        movable = set(holding.filter(do_not_disrupt=False).exclude(checkpoint_signal="").values_list("pk", flat=True))
        if held != wanted or movable != wanted:
            return False  # a job started or changed meanwhile: keep the node
        why = (f"consolidating: moving job{'s' if len(wanted) > 1 else ''} {', '.join(map(str, sorted(wanted)))} "
               f"(checkpointing) to the pool's other nodes, then releasing it")
        if not Node.objects.filter(pk=pn.node_id, state=NodeState.READY).update(
                state=NodeState.DRAINING, state_reason=f"autoscaler: {why}"[:200]):
            return False
        PoolNode.objects.filter(pk=pn.pk).update(state=PoolNodeState.RELEASING, release_started_at=now, reason=why)
        audit_record(actor=ACTOR, action="node.drain", obj=pn.node, reason=f"autoscaler: {why}")
        _event(pn.pool, ScaleEvent.Kind.CONSOLIDATE, f"{name}: {why}", nodes=[name], now=now)
    for job in Job.objects.filter(pk__in=wanted):
        try:
            job_move(actor=ACTOR, job=job)
        except ServiceError as exc:  # it ended meanwhile: nothing to move
            log.info("consolidating %s: job %s not moved: %s", name, job.pk, exc)
    return True


def tick(now=None) -> dict:
    """One autoscaler tick (module docstring)."""
    now = now or timezone.now()
    pools = {p.name: p for p in NodePool.objects.filter(enabled=True)}
    if not pools:
        return {"pools": 0}
    with locks.session_lock(locks.AUTOSCALE_TICK) as taken:
        if not taken:
            return {"skipped": "another autoscaler tick is running"}
        return _tick(now, pools)


def _tick(now, pools) -> dict:
    out = reconcile(now)
    snapshot, _ = build_snapshot(now)
    plan = core.schedule(snapshot)  # read-only: what a pass would do now, with its reservations
    specs = pool_specs(pools.values(), now)
    nodes = _pool_nodes(now)
    budgets = _budgets({j.project for j in snapshot.queued}, now)
    sp = autoscale(snapshot, plan, specs, nodes, budgets, now.timestamp(), movable=_movable())
    for name, jobs in sp.on_booting.items():
        PoolNode.objects.filter(name=name, state=PoolNodeState.BOOTING).update(jobs=[int(j) for j in jobs])
    added = []
    for pool_name, up in sp.up.items():
        pool = pools[pool_name]
        demand = sp.demand_gpus.get(pool_name, 0.0)
        if up.nodes:
            jobs = sum(len(j) for j in up.jobs)
            why = (f"{jobs} waiting jobs ({demand:g} GPUs) need {up.wanted} more node(s) of "
                   f"{pool.gpus_per_node}x{pool.gpu_model}" if up.wanted else f"keeping the pool at its minimum of "
                                                                           f"{pool.min_nodes} nodes")
            if up.limited_by:
                why += f"; adding {up.nodes}: {up.limited_by}"
            added += scale_up(pool, up.nodes, up.jobs, reason=why, demand=demand, now=now)
        elif up.limited_by and _last_kind(pool) != ScaleEvent.Kind.LIMITED:
            with transaction.atomic():
                _event(pool, ScaleEvent.Kind.LIMITED, f"{up.wanted} node(s) wanted, none added: {up.limited_by}",
                       demand=demand, now=now)
    released = []
    by_name = {n.name: n for n in nodes}
    for name in sp.release:
        node = by_name[name]
        idle = now.timestamp() - (node.idle_since or now.timestamp())
        if release(name, reason=f"idle for {idle:.0f} s (pool idle time {pools[node.pool].idle_release_s} s)",
                   now=now):
            released.append(name)
    for name, job_ids in sp.consolidate.items():
        if consolidate(name, job_ids, now=now):
            released.append(name)
    cache.set(NOTES_KEY, sp.notes, timeout=max(60, int(4 * settings.AUTOSCALE_INTERVAL_S)))
    return {**out, "added": added, "released": released, "notes": len(sp.notes),
            "demand_gpus": sp.demand_gpus}


def _last_kind(pool: NodePool) -> str | None:
    return ScaleEvent.objects.filter(pool=pool).values_list("kind", flat=True).first()


def release_all(pool: NodePool) -> list[str]:
    """Delete every machine the pool still has (an operator emptying it, a test cleaning up);
    nodes holding jobs are drained first and left until their jobs end."""
    now = timezone.now()
    done = []
    for pn in PoolNode.objects.filter(pool=pool, state__in=LIVE).select_related("pool"):
        if pn.state == PoolNodeState.READY:
            if release(pn.name, reason="pool emptied by an operator", now=now):
                done.append(pn.name)
            continue
        if pn.node_id and _node_busy(pn.node_id):
            continue
        with transaction.atomic():
            PoolNode.objects.filter(pk=pn.pk).update(state=PoolNodeState.RELEASING, release_started_at=now)
        pn.refresh_from_db()
        if _delete(pn, final_state=PoolNodeState.RELEASED, reason="pool emptied by an operator", now=now):
            done.append(pn.name)
    return done


def waiting_notes(job_ids) -> dict[str, str]:
    """What the autoscaler is doing for each waiting job: "scaling up pool h100: node h100-7 booting (45 s)",
    or why it adds nothing for it (a pool at its maximum, backed off, a spent budget). The
    scheduling pass adds it to the job's reason (scheduler/adapter.py)."""
    wanted = {str(j) for j in job_ids}
    if not wanted:
        return {}
    now = timezone.now()
    out = {}
    for name, pool, created, jobs in PoolNode.objects.filter(state=PoolNodeState.BOOTING).values_list(
            "name", "pool__name", "created_at", "jobs"):
        for j in jobs or []:
            if str(j) in wanted:
                out[str(j)] = f"scaling up pool {pool}: node {name} booting ({(now - created).total_seconds():.0f} s)"
    for j, note in (cache.get(NOTES_KEY) or {}).items():
        if j in wanted and j not in out:
            out[j] = note
    return out


def _notes_quiet() -> bool:
    """Whether waiting_notes has nothing to say to anyone: no node booting, no note kept."""
    return not cache.get(NOTES_KEY) and not PoolNode.objects.filter(state=PoolNodeState.BOOTING).exists()


waiting_notes.quiet = _notes_quiet  # the scheduling pass may then reuse its last plan (scheduler/adapter.py)
