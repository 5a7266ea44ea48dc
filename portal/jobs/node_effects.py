"""What a node's drain, fault or death does to the jobs on it (docs/design.md section 2, "Layers").

Jobs sit above nodes: portal/nodes/ marks the node (draining, down, a GPU unhealthy) and finds
the silent ones, and this module, which may import both, applies the jobs' transitions in the
same transaction: checkpointing jobs move elsewhere, jobs on a dead node are requeued or end
`node_fail`, a draining node with nothing left becomes drained. The operator's drain, the
reaper (jobs/tasks.py), a GPU turning unhealthy (metrics) and an agent's fault reports
(jobs/reports.py) all come here."""
import functools

from django.conf import settings
from django.db import connection, transaction

from portal.core.context import Actor
from portal.core.queue import request_schedule_pass
from portal.nodes.models import GPU, Node, NodeState
from portal.nodes.services import (gpus_mark_scrub_failed, node_mark_down, node_mark_draining,
                                   node_mark_draining_for_fault, nodes_past_deadline)
from scheduler.dispatch import send_stop

from .models import HOLDING, Allocation, Job, JobEvent, JobState
from .states import requeue_holding, transition


def node_drain(*, actor: Actor, node: Node, reason: str = "") -> Node:
    """An operator's drain: no new jobs; jobs that checkpoint move elsewhere (their signal, their
    grace, then requeued to resume); the node becomes drained once the others have ended."""
    with transaction.atomic():
        node = node_mark_draining(actor=actor, node=node, reason=reason)
        migrate_checkpointing_jobs(node=node, why=f"Node {node.name} is being drained.", reason_code="node_drained")
        node_settle_drain(node.pk)
    node.refresh_from_db()
    return node


def node_settle_drain(node_id: int) -> None:
    """A draining node with no job left becomes drained (after a drain, and when a job ends): one
    statement, which changes nothing on a node that is not draining (every end asks it)."""
    with connection.cursor() as cursor:
        cursor.execute(_settle_drain_sql(), [NodeState.DRAINED, node_id, NodeState.DRAINING, node_id, *sorted(HOLDING)])


@functools.cache
def _settle_drain_sql() -> str:
    node, job = Node._meta, Job._meta
    q = connection.ops.quote_name
    return (f"UPDATE {q(node.db_table)} SET {q(node.get_field('state').column)} = %s "
            f"WHERE {q(node.pk.column)} = %s AND {q(node.get_field('state').column)} = %s AND NOT EXISTS "
            f"(SELECT 1 FROM {q(job.db_table)} WHERE {q(job.get_field('node').column)} = %s "
            f"AND {q(job.get_field('state').column)} IN ({', '.join(['%s'] * len(HOLDING))}))")


def migrate_checkpointing_jobs(*, node: Node, why: str, reason_code: str) -> list[int]:
    """Move every checkpointing job off `node` (a drain, a fault), in the caller's transaction: each is
    requeued as its next attempt, and after commit its old attempt gets its checkpoint signal and
    grace (states.requeue_holding). Jobs that do not checkpoint are left to finish."""
    ids = set(Allocation.objects.filter(gpu__node=node, released_at__isnull=True).values_list("job_id", flat=True))
    ids |= set(Job.objects.filter(node=node, state__in=HOLDING).values_list("pk", flat=True))
    moved = []
    for pk, attempt in (Job.objects.filter(pk__in=ids, state__in=HOLDING).exclude(checkpoint_signal="")
                        .order_by("pk").values_list("pk", "attempt")):
        stops = requeue_holding(pk, attempt=attempt, reason_code=reason_code, message=why)
        if stops is None:
            continue
        moved.append(pk)
        _send_stops_on_commit(stops, reason_code)
    if moved:
        transaction.on_commit(request_schedule_pass)
    return moved


def _send_stops_on_commit(stops, reason_code: str) -> None:
    for name, job_id, old, grace, signal in stops:
        transaction.on_commit(lambda n=name, j=job_id, a=old, g=grace, s=signal: send_stop(n, j, a, reason_code, g, s))


def node_drain_for_fault(*, node: Node, problem: str) -> bool:
    """Drain a node its agent reports broken (a GPU it could not scrub, a sandbox it could not kill),
    whatever GPU_HEALTH_AUTO_DRAIN says: no new job lands there until an operator undrains it
    (docs/reliability.md rule 5). Returns True when this call drained it."""
    with transaction.atomic():
        if Node.objects.filter(pk=node.pk, state=NodeState.READY).exists():
            migrate_checkpointing_jobs(node=node, why=f"Node {node.name} was drained: {problem}."[:250],
                                       reason_code="node_drained")
        if not node_mark_draining_for_fault(node=node, problem=problem):
            return False
        node_settle_drain(node.pk)
    return True


def gpus_scrub_failed(*, node: Node, failures: list[dict], job_id) -> list[int]:
    """GPUs whose memory the agent could not clear after a job (docs/reliability.md 2.2).

    The next tenant could read what the last one left, so each GPU turns unhealthy (the scheduler
    skips it) until an operator clears it, and the node is drained, whatever GPU_HEALTH_AUTO_DRAIN
    says (docs/reliability.md rule 5, Slurm's ReturnToService=0). The agent scrubs only GPUs no running
    job shares, so no other job is touched. Returns the GPU indexes marked.
    """
    with transaction.atomic():
        marked = gpus_mark_scrub_failed(node=node, failures=failures, job_id=job_id)
        if marked:
            node_drain_for_fault(node=node, problem=f"memory scrub failed on GPU {', '.join(map(str, marked))}")
    if marked:
        request_schedule_pass()
    return marked


def gpu_unhealthy_handle(*, gpu: GPU, reason: str) -> dict:
    """What follows a GPU turning unhealthy (docs/design.md section 6); runs in the caller's transaction.

    1. Each job holding the GPU: a checkpointing or preemptible one with attempts left goes back to
       the queue as a new attempt (reason `gpu_unhealthy`, the scheduler places it elsewhere) and
       its old attempt gets `agent.stop` after commit (a checkpointing job its signal and grace
       first, and it resumes from its checkpoint). Any other job is not killed for a fault that may
       not touch it: it keeps running, with a warning on its timeline and as its reason.
    2. With GPU_HEALTH_AUTO_DRAIN on, a ready node is drained: no new job lands on it.
    """
    node = Node.objects.get(pk=gpu.node_id)
    what = f"GPU {gpu.index} of node {node.name} is unhealthy ({reason})"
    job_ids = Allocation.objects.filter(gpu=gpu, released_at__isnull=True, job__state__in=HOLDING).values("job_id")
    requeued, warned = [], []
    for job in Job.objects.filter(pk__in=job_ids).order_by("pk"):
        movable = job.preemptible or bool(job.checkpoint_signal)
        if movable and job.attempt < settings.JOB_MAX_ATTEMPTS:
            done = requeue_holding(job.pk, attempt=job.attempt, reason_code="gpu_unhealthy", message=f"{what}.",
                                   reason_message=f"{what}. Requeued to run on other GPUs.")
            if done:
                _send_stops_on_commit(done, "gpu_unhealthy")
                requeued.append(job.pk)
            continue
        why = "it is not preemptible and does not checkpoint" if not movable else "it has no attempts left"
        note = f"{what}. The job keeps running because {why}; check its results."[:300]
        if Job.objects.filter(pk=job.pk, attempt=job.attempt, state__in=HOLDING).update(
                reason_code="gpu_unhealthy", reason_message=note):
            JobEvent.objects.create(job=job, attempt=job.attempt, state=job.state, message=note)
            warned.append(job.pk)
    drained = False
    if settings.GPU_HEALTH_AUTO_DRAIN and node.state == NodeState.READY:
        node_drain(actor=Actor(user=None, label="gpu-health"), node=node, reason=f"Auto-drained: {what}"[:200])
        drained = True
    return {"requeued": requeued, "warned": warned, "drained": drained}


def job_requeue_after_node_fault(job: Job, message: str) -> str:
    """A job its node failed goes back to the queue as a new attempt (its old attempt's reports
    turn stale), or ends `node_fail` once it has had JOB_MAX_ATTEMPTS. Returns "requeued",
    "node_fail", or "" when the job was no longer holding its node."""
    if job.attempt < settings.JOB_MAX_ATTEMPTS:
        with transaction.atomic():
            if transition(job.pk, to=JobState.QUEUED, from_states=HOLDING, attempt=job.attempt, node=None,
                          message=f"{message} Requeued as attempt {job.attempt + 1}.", reason_code="node_fail",
                          reason_message=f"{message} Requeued."):
                Job.objects.filter(pk=job.pk).update(attempt=job.attempt + 1)
                return "requeued"
        return ""
    if transition(job.pk, to=JobState.NODE_FAIL, from_states=HOLDING, attempt=job.attempt, message=message,
                  reason_code="node_fail", reason_message=message):
        return "node_fail"
    return ""


def nodes_reap() -> dict:
    """The reaper (every NODE_REAP_INTERVAL_S, jobs/tasks.py): each node silent past its deadline
    (nodes.services.nodes_past_deadline, which keeps the portal's own trouble from counting) is
    marked down and, in the same transaction, each job it held is requeued or ends `node_fail`."""
    silent, result = nodes_past_deadline()
    if not silent:
        return result
    requeued = failed = 0
    for node in silent:
        with transaction.atomic():
            if not node_mark_down(node):
                continue  # it spoke meanwhile
            job_ids = set(Job.objects.filter(state__in=HOLDING, node=node).values_list("pk", flat=True))
            job_ids |= set(Job.objects.filter(state__in=HOLDING, allocations__gpu__node=node,
                                              allocations__released_at__isnull=True).values_list("pk", flat=True))
            for job in Job.objects.filter(pk__in=job_ids):
                outcome = job_requeue_after_node_fault(job, f"Node {node.name} stopped answering.")
                requeued += outcome == "requeued"
                failed += outcome == "node_fail"
    request_schedule_pass()
    return {**result, "requeued": requeued, "node_fail": failed}
