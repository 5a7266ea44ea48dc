"""An agent's heartbeat, taken above the apps it touches: the node's own record (nodes), its GPU
samples (metrics: live tiles, history, health rules) and the jobs it lists (jobs: a launch the
node never started or a job it lost is requeued, an attempt it must not run is stopped)."""
import logging
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.utils import timezone
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.response import Response

from portal.core.queue import request_schedule_pass
from portal.jobs.models import Allocation, Job, JobState
from portal.jobs.node_effects import job_requeue_after_node_fault
from portal.jobs.reports import stale_reports
from portal.metrics.services import samples_ingest, samples_own
from portal.nodes.agent_api import AgentView, HeartbeatSerializer, heartbeat_fast, samples_check
from portal.nodes.models import Node, NodeState
from portal.nodes.services import NodeTokenRevoked, node_heartbeat, raw_sql

log = logging.getLogger(__name__)


class HeartbeatView(AgentView):
    node_token_confirmed_later = True  # node_heartbeat's UPDATE checks the token: auth may use memory

    @extend_schema(request=HeartbeatSerializer, responses=inline_serializer("HeartbeatAnswer", {
        "drain": serializers.BooleanField(), "stop": serializers.ListField(child=serializers.DictField()),
        "refused": serializers.ListField(child=serializers.DictField(), help_text=(
            "Samples not stored: [{position, gpu_uuid, errors}]; the rest of the batch was."))}))
    def post(self, request):
        fast = heartbeat_fast(request.data)
        cached = None  # the fast path takes bodies without cached_datasets (sent only when they change)
        if fast is not None:
            samples, jobs = fast
            positions, refused = range(len(samples)), []
        else:
            data = HeartbeatSerializer(data=request.data)
            if not data.is_valid():
                if not Node.objects.filter(pk=self.node.pk, token_digest=self.node.token_digest).exists():
                    raise AuthenticationFailed("Invalid node token.")  # a revoked token learns nothing more
                raise serializers.ValidationError(data.errors)
            samples, positions, refused = samples_check(data.validated_data["samples"])
            jobs = data.validated_data["jobs"]
            cached = data.validated_data.get("cached_datasets")
        try:
            answer = agent_heartbeat(node=self.node, samples=samples, jobs=jobs, cached_datasets=cached)
        except NodeTokenRevoked:
            raise AuthenticationFailed("Invalid node token.") from None
        # The service numbers its refusals within what it was given: back to the agent's batch.
        refused += [{**r, "position": positions[r["position"]]} for r in answer.get("refused", [])]
        return Response({**answer, "refused": sorted(refused, key=lambda r: r["position"])})


def agent_heartbeat(*, node: Node, samples: list[dict], jobs: list[dict],
                    cached_datasets: list[str] | None = None) -> dict:
    """Record the heartbeat and answer with what the agent must do: drain, stop stale jobs.
    ``cached_datasets``: the digests its dataset cache holds now, when they changed (None: as before)."""
    node_heartbeat(node=node)
    if cached_datasets is not None:
        Node.objects.filter(pk=node.pk).update(cached_datasets=sorted(set(cached_datasets)))
    refused = []
    if samples:
        # Only this node's GPUs: a node token must not write another node's live tile or health.
        samples, refused = samples_own(node=node, samples=samples)
    if samples:
        # Live tiles read the latest sample per GPU from the cache (Redis in production).
        cache.set_many({f"gpu-sample:{s.get('gpu_uuid')}": s for s in samples if s.get("gpu_uuid")}, timeout=300)
        # Charts and health rules need history in PostgreSQL: one COPY batch per heartbeat.
        samples_ingest(node=node, samples=samples)
    requeue_lost_launches(node=node, reported=jobs)
    return {"drain": node.state in (NodeState.DRAINING, NodeState.DRAINED), "stop": stale_reports(node=node,
                                                                                              reported=jobs),
            "refused": refused}


def requeue_lost_launches(*, node: Node, reported: list[dict]) -> list[int]:
    """Reconcile what the node holds with what the portal placed there: a job assigned or starting
    on this node for LAUNCH_LOST_S that the heartbeat does not list (the agent lists what it runs
    and what it is launching) never reached a sandbox, re-sent launches included: it is requeued
    as a new attempt rather than held, and billed, with nothing running. So is a job `running`
    there for LAUNCH_LOST_S that the heartbeat does not list: the agent lists every sandbox until
    the portal has taken its end (an end found after a restart included), so the node lost it
    with no exit to report (a sandbox removed, a node rebooted while its agent was down); it
    would otherwise stay running forever. Either ends `node_fail` once out of attempts. The other
    direction, a sandbox the portal does not know or of a stale attempt, is stopped by
    `stale_reports`. Returns the requeued job ids."""
    cutoff = timezone.now() - timedelta(seconds=settings.LAUNCH_LOST_S)
    since = connection.ops.adapt_datetimefield_value(cutoff)
    held = {(str(r.get("job_id")), int(r.get("attempt") or 0)) for r in reported}
    states = [JobState.ASSIGNED.value, JobState.STARTING.value, JobState.RUNNING.value]
    # Every heartbeat asks this: plain SQL that starts from this node's jobs and open allocations
    # (indexed), never from every job in those states across the fleet.
    late = raw_sql("SELECT j.id, j.attempt FROM {job} j WHERE j.node_id = %s AND j.state IN (%s, %s, %s) "
                   "AND j.state_changed_at < %s UNION SELECT j.id, j.attempt FROM {allocation} a "
                   "JOIN {gpu} g ON g.id = a.gpu_id JOIN {job} j ON j.id = a.job_id WHERE g.node_id = %s "
                   "AND a.released_at IS NULL AND j.state IN (%s, %s, %s) AND j.state_changed_at < %s",
                   [node.pk, *states, since, node.pk, *states, since], fetch=True,
                   job=Job._meta.db_table, allocation=Allocation._meta.db_table)
    lost = [pk for pk, attempt in late if (str(pk), attempt) not in held]
    requeued = []
    for job in Job.objects.filter(pk__in=lost, state__in=states, state_changed_at__lt=cutoff) if lost else ():
        if (str(job.pk), job.attempt) in held:
            continue
        if job.state == JobState.RUNNING:
            why = f"Node {node.name} no longer holds it (running, but not among what the node runs; its exit is lost)."
        else:
            why = (f"Node {node.name} never started it ({job.state} for over {settings.LAUNCH_LOST_S}s, "
                   f"not on the node).")
        if job_requeue_after_node_fault(job, why):
            requeued.append(job.pk)
    if requeued:
        log.warning("node %s: requeued %s, placed there but not held by the node", node.name, requeued)
        request_schedule_pass()
    return requeued
