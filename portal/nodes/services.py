"""Writes for nodes and GPUs: registration by operators, drain and undrain, the reaper's findings.

Nodes import nothing of jobs (docs/design.md section 2): what a drain, a fault or a node's death
does to the jobs on it is portal/jobs/node_effects.py's, which calls these for the node's part."""
import copy
import logging
import re
import secrets
import time
import uuid
from datetime import timedelta
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from portal.accounts import tokens
from portal.core.context import Actor
from portal.core.errors import Conflict, Forbidden, InvalidInput
from portal.core.queue import request_schedule_pass
from portal.core.prepared import Prepared
from portal.core.services import audit_record, require_operator
from scheduler.dispatch import send_probe

from .models import GPU, GPUHealth, GPUMode, Node, NodeState, ReaperState

NODES_REFUSAL = "Only site staff operate nodes."
GPU_SPEC = re.compile(r"^(?P<count>\d{1,3})x(?P<model>[A-Za-z0-9][A-Za-z0-9._-]*?)(?:-(?P<mem>\d{1,4})GB)?$")
NODE_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
QUEUE_PROBE_RESEND_S = 30
REAPED_REASON = "no heartbeat"  # state_reason of a node the reaper marked down
MEMORY_BY_MODEL = {"H100": 80, "H200": 141, "A100": 80, "V100": 32, "P100": 16, "T4": 16, "L4": 24, "A10": 24}


def parse_gpu_spec(text: str) -> tuple[int, str, int]:
    """'8xH100-80GB' -> (8, 'H100-80GB', 81920). The model name keeps its memory suffix."""
    match = GPU_SPEC.match(text.strip())
    if not match:
        raise InvalidInput(f"{text!r} is not like '8xH100-80GB'.", field="gpus")
    count = int(match["count"])
    mem_gb = int(match["mem"]) if match["mem"] else MEMORY_BY_MODEL.get(match["model"], 16)
    model = f"{match['model']}-{mem_gb}GB" if match["mem"] or match["model"] in MEMORY_BY_MODEL else match["model"]
    return count, model, mem_gb * 1024


def node_add(*, actor: Actor, name: str, gpus: str = "", pool: str = "default", shared: bool = False,
             cpus: int = 0, memory_mb: int = 0) -> tuple[Node, str]:
    """Create a node with GPUs from a spec; returns the node and its agent token (shown once)."""
    require_operator(actor, NODES_REFUSAL)
    if not NODE_NAME.match(name):
        raise InvalidInput("Use lowercase letters, digits and hyphens (a DNS label).", field="name")
    count, model, memory = parse_gpu_spec(gpus) if gpus else (0, "", 0)
    secret = tokens.generate("gpn")
    with transaction.atomic():
        if Node.objects.filter(name=name).exists():
            raise Conflict(f"A node named {name!r} already exists.", field="name")
        node = Node.objects.create(name=name, pool=pool, cpus=cpus, memory_mb=memory_mb,
                                   token_digest=tokens.digest(secret), **_queue_verified_in_tests())
        GPU.objects.bulk_create([
            GPU(node=node, index=i, uuid=f"GPU-{uuid.uuid4()}", model=model, memory_mb=memory,
                mode=GPUMode.SHARED if shared else GPUMode.WHOLE)
            for i in range(count)
        ])
        audit_record(actor=actor, action="node.add", obj=node, gpus=gpus, pool=pool, shared=shared)
    request_schedule_pass()
    return node, secret


def node_mark_draining(*, actor: Actor, node: Node, reason: str = "") -> Node:
    """The node's part of an operator's drain: no new jobs land on it. It stays draining until
    jobs.node_effects.node_settle_drain finds no job left there (node_effects.node_drain moves
    the checkpointing ones away first, in the same transaction)."""
    require_operator(actor, NODES_REFUSAL)
    if node.state not in (NodeState.READY, NodeState.DRAINING):
        raise Conflict(f"Node {node.name} is {node.state}; only a ready node can be drained.")
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(state=NodeState.DRAINING,
                                               state_reason=reason or f"drained by {actor.user}")
        audit_record(actor=actor, action="node.drain", obj=node, reason=reason)
    node.refresh_from_db()
    return node


def node_undrain(*, actor: Actor, node: Node) -> Node:
    require_operator(actor, NODES_REFUSAL)
    if node.state not in (NodeState.DRAINING, NodeState.DRAINED):
        raise Conflict(f"Node {node.name} is {node.state}; only a draining or drained node can be undrained.")
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(state=NodeState.READY, state_reason="")
        audit_record(actor=actor, action="node.undrain", obj=node)
    node.refresh_from_db()
    request_schedule_pass()
    return node


def node_rotate_token(*, actor: Actor, node: Node) -> str:
    """A new agent token for the node (the old one stops working at once)."""
    require_operator(actor, NODES_REFUSAL)
    secret = tokens.generate("gpn")
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(token_digest=tokens.digest(secret))
        audit_record(actor=actor, action="node.rotate_token", obj=node)
    return secret


# Nodes by token digest, for heartbeats only (node_authenticate's confirmed_later): a fleet's
# heartbeats then read no node row; each one's UPDATE names the digest, so a rotated token or a
# removed node is refused by the very next heartbeat (node_heartbeat raises NodeTokenRevoked).
_HEARTBEAT_NODES: dict[str, tuple[float, Node]] = {}
HEARTBEAT_NODE_TTL_S = 60.0


class NodeTokenRevoked(Exception):
    """The node's token changed (rotated) or the node is gone since this process read it."""


# Compiled once per process (portal/core/prepared.py): every agent request authenticates, and
# compiling the ORM's query, or a RawQuerySet's mapping of its columns to fields, cost more CPU
# than running it.
_NODE_COLUMNS = [f.attname for f in Node._meta.concrete_fields]
_NODE_BY_DIGEST = Prepared(lambda digest: Node.objects.filter(token_digest=digest).order_by("id").values_list(
    *_NODE_COLUMNS)[:1], digest="?digest")  # a placeholder no token digest is


def node_authenticate(secret: str, *, confirmed_later: bool = False) -> Node | None:
    """The node a token belongs to, or None. With ``confirmed_later`` (the heartbeat, whose own
    UPDATE checks the token again) a node read in the last minute is answered from memory."""
    if not tokens.looks_valid(secret, kind="gpn"):
        return None
    digest = tokens.digest(secret)
    if confirmed_later:
        hit = _HEARTBEAT_NODES.get(digest)
        if hit is not None and hit[0] > time.monotonic():
            return copy.copy(hit[1])
    found = _NODE_BY_DIGEST.rows(digest=digest)
    node = Node.from_db("default", _NODE_COLUMNS, found[0]) if found else None
    if node is not None and confirmed_later:
        if len(_HEARTBEAT_NODES) > 100_000:
            _HEARTBEAT_NODES.clear()
        _HEARTBEAT_NODES[digest] = (time.monotonic() + HEARTBEAT_NODE_TTL_S, copy.copy(node))
    return node


GPU_UNUSABLE_PREFIX = "Unusable for "  # health_reason of GPUs the node's sandbox cannot serve


def agent_register(*, node: Node, name: str, cpus: int, memory_mb: int, sandbox: str, gpus: list[dict],
                   capabilities: dict | None = None, gpus_unusable: str = "", protocol_version: str = "",
                   cached_datasets: list[str] | None = None) -> Node:
    """The agent's real inventory replaces what the operator declared; a down node comes back.
    ``protocol_version``: the agent protocol it speaks (agents/protocol.py; "" for an agent older
    than the field), kept on the node.

    ``gpus_unusable`` says why the agent's sandbox cannot give GPUs to jobs (a Docker engine
    without the NVIDIA runtime): its healthy GPUs turn unhealthy with that reason, so the
    scheduler places no GPU job there and the nodes page says why. A later registration
    without it (the runtime was installed, the agent restarted) puts them back in service."""
    if name != node.name:
        raise Forbidden(f"This token belongs to node {node.name}, not {name}.", field="name")
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        _refuse_other_nodes_gpus(node=node, gpus=gpus)
        existing = {g.index: g for g in node.gpus.all()}
        seen = set()
        for g in gpus:
            index = int(g["index"])
            seen.add(index)
            fields = {"uuid": str(g["uuid"])[:64], "model": _model_name(g), "memory_mb": int(g.get("memory_mb") or 0),
                      "pci_bus_id": str(g.get("pci_bus_id") or "")[:32], "topology": dict(g.get("topology") or {})}
            if index in existing:
                gpu = existing[index]
                changed = [k for k, v in fields.items() if getattr(gpu, k) != v]
                if changed:
                    # A UUID moving between this node's indexes frees it first (its old row takes
                    # its own new UUID further on, or is marked missing below).
                    node.gpus.filter(uuid=fields["uuid"]).exclude(pk=gpu.pk).update(uuid=f"gone-{uuid.uuid4()}")
                    for k in changed:
                        setattr(gpu, k, fields[k])
                    gpu.save(update_fields=changed)
            else:
                node.gpus.filter(uuid=fields["uuid"]).update(uuid=f"gone-{uuid.uuid4()}")
                GPU.objects.create(node=node, index=index, **fields)
        for index, gpu in existing.items():
            if index not in seen:
                GPU.objects.filter(pk=gpu.pk).update(health="unhealthy", health_reason="missing from the agent's inventory")
        _gpus_usable_apply(node=node, sandbox=sandbox, problem=gpus_unusable)
        updates = {"cpus": cpus, "memory_mb": memory_mb, "sandbox": sandbox[:16], "last_heartbeat_at": timezone.now(),
                   "capabilities": capabilities or {}, "protocol_version": protocol_version}
        if cached_datasets is not None:  # the digests in its dataset cache (agents/datasets.py)
            updates["cached_datasets"] = sorted(set(cached_datasets))
        if node.state == NodeState.DOWN:
            updates.update(state=NodeState.READY, state_reason="")
        # No new jobs until this agent proves it receives node.<name> (a restart may bring a wrong --broker).
        nonce = secrets.token_hex(16)
        updates.update(agent_registered_at=updates["last_heartbeat_at"], queue_probe=nonce, queue_verified_at=None,
                       queue_probe_sent_at=updates["last_heartbeat_at"])
        updates.update(_queue_verified_in_tests())
        Node.objects.filter(pk=node.pk).update(**updates)
        audit_record(actor=Actor(user=None, label=f"node:{node.name}"), action="node.register", obj=node,
                     gpus=len(gpus), sandbox=sandbox)
        transaction.on_commit(lambda: send_probe(node.name, nonce))
    request_schedule_pass()
    node.refresh_from_db()
    return node


def _refuse_other_nodes_gpus(*, node: Node, gpus: list[dict]) -> None:
    """A node token speaks for its own node only: a GPU UUID registered on another node stays
    there (taking it would rename that node's GPU and leave it schedulable). A GPU that really
    moved (a machine re-imaged under a new name) is released by removing the old node first."""
    taken = set(GPU.objects.filter(uuid__in=[str(g["uuid"]) for g in gpus]).exclude(node=node)
                .values_list("uuid", flat=True))
    for position, g in enumerate(gpus):
        if str(g["uuid"]) in taken:
            raise Conflict(f"GPU {g['uuid']} is registered on another node; an operator must remove it there "
                           "before this node can register it.", field=f"gpus.{position}.uuid", code="gpu_taken")


def _gpus_usable_apply(*, node: Node, sandbox: str, problem: str) -> None:
    """Mark or clear "unusable" on the node's GPUs; runs in agent_register's transaction.
    Only this rule's own verdicts are cleared: an Xid or a failed scrub stays for the operator."""
    gpus = GPU.objects.filter(node=node)
    if problem:
        reason = f"{GPU_UNUSABLE_PREFIX}{sandbox[:16]} jobs: {problem}"[:200]
        changed = gpus.filter(health=GPUHealth.HEALTHY).update(health=GPUHealth.UNHEALTHY, health_reason=reason)
    else:
        changed = gpus.filter(health=GPUHealth.UNHEALTHY, health_reason__startswith=GPU_UNUSABLE_PREFIX).update(
            health=GPUHealth.HEALTHY, health_reason="")
    if changed:
        audit_record(actor=Actor(user=None, label=f"node:{node.name}"), action="node.gpus_usable", obj=node,
                     gpus=changed, usable=not problem, reason=problem)


def _queue_verified_in_tests() -> dict:
    return {"queue_verified_at": timezone.now(), "queue_probe": ""} if settings.TEST_NODES_SKIP_QUEUE_PROBE else {}


def _queue_probe_resend(node: Node) -> None:
    """A probe still unanswered QUEUE_PROBE_RESEND_S after it was sent goes again (the broker may
    have been down at registration); once a while, so a misconfigured agent does not fill its queue."""
    if not node.queue_probe or node.queue_verified_at is not None:
        return
    now = timezone.now()
    due = now - timedelta(seconds=QUEUE_PROBE_RESEND_S)
    if Node.objects.filter(pk=node.pk, queue_probe=node.queue_probe, queue_probe_sent_at__lt=due).update(
            queue_probe_sent_at=now):
        transaction.on_commit(lambda: send_probe(node.name, node.queue_probe))


def agent_probe_answer(*, node: Node, nonce: str) -> str:
    """The agent got the probe from its queue: from now on the node takes jobs. Returns
    "verified", or "duplicate" for a probe answered again; an unknown nonce (a probe of an
    earlier registration) is a Conflict."""
    with transaction.atomic():
        if not Node.objects.filter(pk=node.pk, queue_probe=nonce).exclude(queue_probe="").update(
                queue_probe="", queue_verified_at=timezone.now()):
            if node.queue_verified_at is not None and not node.queue_probe:
                return "duplicate"
            raise Conflict("This probe is not the node's current one (the agent registered again since).",
                           field="nonce", code="stale")
        audit_record(actor=Actor(user=None, label=f"node:{node.name}"), action="node.queue_verified", obj=node)
    request_schedule_pass()
    return "verified"


def _model_name(g: dict) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100-80GB': the short name quotas and job specs use."""
    raw = str(g.get("model") or "")
    m = re.search(r"([A-Z]+\d+[A-Za-z]*)", raw.replace("NVIDIA", ""))
    mem_gb = round(int(g.get("memory_mb") or 0) / 1024)
    return f"{m.group(1)}-{mem_gb}GB" if m and mem_gb else raw[:64]


def raw_sql(template: str, params: list, *, fetch: bool = False, **tables) -> list[tuple]:
    """One statement of the heartbeat's hot path, as plain SQL (on PostgreSQL and SQLite alike):
    the ORM's compiling of a query cost more CPU than running it. ``{node}`` and ``{gpu}`` name
    this app's tables; a caller names others in ``tables``."""
    tables = {"node": Node._meta.db_table, "gpu": GPU._meta.db_table, **tables}
    with connection.cursor() as cursor:
        cursor.execute(template.format(**tables), params)
        return cursor.fetchall() if fetch else []


def _datetime(value):
    """A timestamp column read by plain SQL: SQLite gives text (naive UTC), PostgreSQL a datetime."""
    if isinstance(value, str):
        value = parse_datetime(value)
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt_timezone.utc)
    return value


def _db_now():
    return connection.ops.adapt_datetimefield_value(timezone.now())


def node_heartbeat(*, node: Node) -> Node:
    """Record a heartbeat of ``node`` and read back what may have changed since (its state, the
    queue probe): one statement, which also checks the token once more (node_authenticate may
    answer from memory): NodeTokenRevoked when it was rotated or the node removed. A node back
    before re-registering turns ready: the reaper already failed its jobs, their reports are stale."""
    row = raw_sql("UPDATE {node} SET last_heartbeat_at = %s WHERE id = %s AND token_digest = %s "
                  "RETURNING state, queue_probe, queue_verified_at", [_db_now(), node.pk, node.token_digest],
                  fetch=True)
    if not row:
        _HEARTBEAT_NODES.pop(node.token_digest, None)
        raise NodeTokenRevoked(node.name)
    node.state, node.queue_probe, node.queue_verified_at = row[0][0], row[0][1], _datetime(row[0][2])
    _queue_probe_resend(node)
    if node.state == NodeState.DOWN:
        Node.objects.filter(pk=node.pk, state=NodeState.DOWN).update(state=NodeState.READY, state_reason="")
    return node


def gpus_mark_scrub_failed(*, node: Node, failures: list[dict], job_id) -> list[int]:
    """GPUs whose memory the agent could not clear after a job (docs/reliability.md 2.2): each turns
    unhealthy (the scheduler skips it) until an operator clears it. Returns the GPU indexes marked;
    jobs.node_effects.gpus_scrub_failed drains the node for them."""
    system = Actor(user=None, label=f"node:{node.name}")
    marked = []
    with transaction.atomic():
        for f in failures:
            gpu = GPU.objects.filter(node=node, index=f["gpu_index"]).first()
            if gpu is None:
                continue
            reason = f"Memory scrub failed after job {job_id}: {f['message']}"[:200]
            GPU.objects.filter(pk=gpu.pk).update(health=GPUHealth.UNHEALTHY, health_reason=reason)
            audit_record(actor=system, action="gpu.unhealthy", obj=gpu, reason=reason)
            marked.append(gpu.index)
    return marked


def node_mark_draining_for_fault(*, node: Node, problem: str) -> bool:
    """The node's part of a drain for a fault its agent reports: a ready node turns draining
    (conditional: a node the reaper marked down meanwhile, or one already drained, keeps its
    state). Returns True when this call drained it."""
    reason = f"Auto-drained: {problem}"[:200]
    with transaction.atomic():
        if not Node.objects.filter(pk=node.pk, state=NodeState.READY).update(state=NodeState.DRAINING,
                                                                                 state_reason=reason):
            return False
        audit_record(actor=Actor(user=None, label=f"node:{node.name}"), action="node.drain", obj=node, reason=reason)
    return True


def nodes_past_deadline() -> tuple[list[Node], dict]:
    """The reaper's finding: the nodes silent past their deadline, and its figures (the answer of
    jobs.node_effects.nodes_reap when no node is to be marked down). node_mark_down marks each.

    The deadline is NODE_TIMEOUT_S after a node's last heartbeat. The portal's own trouble is not
    a node failure (docs/reliability.md, section 8):
    1. If the reaper itself could not run for a while (database, broker, workers or beat out,
       every portal process restarted), no heartbeat was heard either: every node gets a fresh
       lease from now before anyone is reaped.
    2. If the portal hears heartbeats late (overloaded: requests queue before a worker takes
       them), every node is heard late alike: the typical node's silence tells by how much
       (`ingest_lag`), and every deadline moves that much later while the lag lasts and for
       NODE_TIMEOUT_S after it, so a dead node is still found, only later, and a live one is not
       taken for dead.
    3. If most nodes went silent at once, the portal side (database, broker, network) is the
       likelier culprit: mark nothing, say so, and count leases afresh once it is over (the
       Kubernetes all-zones rule), so the nodes that come back last are not reaped for it.
    """
    now = timezone.now()
    cutoff = now - timedelta(seconds=settings.NODE_TIMEOUT_S)
    fresh_since = _reaper_mark_run(now)
    if fresh_since > cutoff:
        return [], {"down": 0, "fresh_lease_until": fresh_since + timedelta(seconds=settings.NODE_TIMEOUT_S)}
    live = Node.objects.filter(state__in=[NodeState.READY, NodeState.DRAINING, NodeState.DRAINED])
    heard = list(live.exclude(last_heartbeat_at__isnull=True).values_list("last_heartbeat_at", flat=True))
    lag = _reaper_ingest_lag(now, ingest_lag(now, heard))
    total = live.count()
    silent = list(live.filter(Q(last_heartbeat_at__lt=cutoff) | Q(last_heartbeat_at__isnull=True,
                                                                    created_at__lt=cutoff)))
    if not silent:
        return [], {"down": 0, **({"ingest_lag_s": round(lag, 1)} if lag else {})}
    # Nodes this reaper marked down lately count as silent too: a portal overloaded for a while
    # loses nodes a few at a time, each batch under the threshold, but not all of them.
    recent = Node.objects.filter(state=NodeState.DOWN, state_reason=REAPED_REASON,
                                 last_heartbeat_at__gte=now - timedelta(seconds=3 * settings.NODE_TIMEOUT_S)).count()
    if total + recent >= 3 and len(silent) + recent > (total + recent) * settings.NODE_MASS_FAILURE_FRACTION:
        logging.getLogger(__name__).error(
            "%d of %d nodes silent at once (%d of them already marked down lately): suspecting the portal "
            "side, not marking them down", len(silent) + recent, total + recent, recent)
        ReaperState.objects.filter(pk=1).update(leases_fresh_since=now)
        return [], {"down": 0, "suspected_portal_failure": len(silent) + recent}
    if lag:
        late_cutoff = cutoff - timedelta(seconds=lag)
        held = sum(1 for node in silent if (node.last_heartbeat_at or node.created_at) >= late_cutoff)
        silent = [node for node in silent if (node.last_heartbeat_at or node.created_at) < late_cutoff]
        if held:
            logging.getLogger(__name__).warning(
                "%d node(s) silent for over %gs not marked down: the portal hears heartbeats %.0fs late, "
                "so their deadline is %.0fs", held, settings.NODE_TIMEOUT_S, lag, settings.NODE_TIMEOUT_S + lag)
        if not silent:
            return [], {"down": 0, "ingest_lag_s": round(lag, 1), "held": held}
    return silent, {"down": len(silent)}


def node_mark_down(node: Node) -> bool:
    """Mark a node the reaper found silent down, in the caller's transaction; False when it spoke
    since it was read (its last heartbeat moved) or is already down."""
    if not Node.objects.filter(pk=node.pk, last_heartbeat_at=node.last_heartbeat_at).exclude(
            state=NodeState.DOWN).update(state=NodeState.DOWN, state_reason=REAPED_REASON):
        return False
    audit_record(actor=Actor(user=None, label="reaper"), action="node.down", obj=node)
    return True


def ingest_lag(now, heard: list) -> float:
    """How late the portal hears heartbeats (seconds), from when the nodes were last heard.

    An agent sends its next heartbeat NODE_HEARTBEAT_INTERVAL_S after the portal answered the
    last one, so in a fleet heard on time the time since each node's last heartbeat is at most an
    interval (plus the answer's latency). A portal answering every request d seconds late
    stretches every node's period to interval + d: in a fleet whose phases are spread over the
    period, the median silence is half of it (d = 2 * median - interval); in one that beats in
    step (every agent started or reconnected at once) the median alone would read d as up to an
    interval too high, but there the 90th percentile silence is at most interval + d. The lag is
    the lower of the two readings. The lower median of at least three nodes is that of the live
    ones while fewer than half are dead (more is the mass-failure brake's case)."""
    if len(heard) < 3:
        return 0.0
    ages = sorted((now - at).total_seconds() for at in heard)
    median, p90 = ages[(len(ages) - 1) // 2], ages[(len(ages) * 9 - 1) // 10]
    return max(0.0, min(2 * median, p90) - settings.NODE_HEARTBEAT_INTERVAL_S)


def _reaper_ingest_lag(now, measured: float) -> float:
    """The ingest lag that moves deadlines now: `measured` when above one heartbeat interval (or
    the spell's worst, falling a second a second, if higher), else the last such lag for
    NODE_TIMEOUT_S after it (the queued heartbeats are still
    being heard: a node whose own was among the last is not reaped for it). Logs and audits the
    portal falling behind and catching up."""
    behind = measured > settings.NODE_HEARTBEAT_INTERVAL_S
    log = logging.getLogger(__name__)
    with transaction.atomic():
        state = ReaperState.objects.select_for_update().get(pk=1)
        holding = state.ingest_lag_at is not None and (
            now - state.ingest_lag_at).total_seconds() < settings.NODE_TIMEOUT_S
        if behind:
            if not holding:
                log.warning("the portal hears heartbeats %.0fs late (overloaded): every node's deadline moves "
                            "from %gs to %.0fs until it catches up", measured, settings.NODE_TIMEOUT_S,
                            settings.NODE_TIMEOUT_S + measured)
                audit_record(actor=Actor(user=None, label="reaper"), action="reaper.portal_behind", obj=state,
                             ingest_lag_s=round(measured, 1))
                lag = measured
            else:  # the worst lag of this spell, falling by a second a second: the median is noisy
                lag = max(measured, state.ingest_lag_s - (now - state.ingest_lag_at).total_seconds())
            state.ingest_lag_s, state.ingest_lag_at = lag, now
            state.save(update_fields=["ingest_lag_s", "ingest_lag_at"])
            return lag
        if holding:
            return state.ingest_lag_s
        if state.ingest_lag_at is not None:
            log.warning("the portal hears heartbeats on time again (lag %.0fs): node deadlines are %gs again",
                        measured, settings.NODE_TIMEOUT_S)
            audit_record(actor=Actor(user=None, label="reaper"), action="reaper.portal_caught_up", obj=state,
                         ingest_lag_s=round(measured, 1), held_lag_s=round(state.ingest_lag_s, 1))
            state.ingest_lag_s, state.ingest_lag_at = 0.0, None
            state.save(update_fields=["ingest_lag_s", "ingest_lag_at"])
        return 0.0


def _reaper_mark_run(now):
    """Record this reaper run; returns since when every node's lease counts (ReaperState)."""
    with transaction.atomic():
        state, created = ReaperState.objects.select_for_update().get_or_create(
            pk=1, defaults={"last_run_at": now, "leases_fresh_since": now - timedelta(days=1)})
        gap = (now - state.last_run_at).total_seconds()
        if not created and gap > 3 * settings.NODE_REAP_INTERVAL_S:
            logging.getLogger(__name__).warning(
                "the reaper last ran %.0fs ago (every %gs expected): the portal was out, so every node gets a "
                "fresh lease of %gs before anyone is marked down", gap, settings.NODE_REAP_INTERVAL_S,
                settings.NODE_TIMEOUT_S)
            state.leases_fresh_since = now
        state.last_run_at = max(state.last_run_at, now)
        state.save(update_fields=["last_run_at", "leases_fresh_since"])
    return state.leases_fresh_since
