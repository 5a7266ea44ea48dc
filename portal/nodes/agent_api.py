"""The agent API, /api/agent/v1/: node agents report up (register, heartbeat, job events, logs).

Only node tokens (gpn_...) authenticate here, and a node token authenticates nowhere else.
409 means "stale": the agent must stop that attempt and start nothing for it.
"""
from django.conf import settings
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.core.api import StrictSerializer
from portal.jobs.reports import job_append_log, job_confirm, job_report

from .auth import IsNode, NodeTokenAuthentication
from .services import agent_heartbeat, agent_register


class AgentView(APIView):
    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]
    throttle_classes = []  # a fleet heartbeats constantly; node tokens are the gate

    @property
    def node(self):
        return self.request.auth


class GpuInventorySerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=255)
    uuid = serializers.CharField(max_length=64)
    model = serializers.CharField(max_length=128)
    memory_mb = serializers.IntegerField(min_value=0)
    pci_bus_id = serializers.CharField(max_length=32, required=False, allow_blank=True, default="")


class RegisterSerializer(StrictSerializer):
    name = serializers.CharField(max_length=63)
    cpus = serializers.IntegerField(min_value=0)
    memory_mb = serializers.IntegerField(min_value=0)
    sandbox = serializers.CharField(max_length=16)
    gpus = GpuInventorySerializer(many=True)
    capabilities = serializers.DictField(child=serializers.BooleanField(), required=False, default=dict)


class RegisterView(AgentView):
    @extend_schema(request=RegisterSerializer, responses=inline_serializer("Registered", {
    # Why the agent's sandbox cannot give its GPUs to jobs (docker without the NVIDIA runtime); "" = it can.
    gpus_unusable = serializers.CharField(max_length=150, required=False, allow_blank=True, default="")
        "node": serializers.CharField(), "heartbeat_interval_s": serializers.FloatField(),
        "lease_s": serializers.FloatField(), "fence_grace_s": serializers.FloatField()}))
    def post(self, request):
        data = RegisterSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = agent_register(node=self.node, **data.validated_data)
        # The agent stops its sandboxes when no heartbeat was answered for lease_s (SIGTERM, then
        # SIGKILL after fence_grace_s): NODE_TIMEOUT_S covers both (portal/settings.py).
        return Response({"node": node.name, "heartbeat_interval_s": settings.NODE_HEARTBEAT_INTERVAL_S,
                         "lease_s": settings.AGENT_LEASE_S, "fence_grace_s": settings.AGENT_FENCE_GRACE_S})


class JobKeySerializer(serializers.Serializer):
    job_id = serializers.CharField(max_length=32)
    attempt = serializers.IntegerField(min_value=0)
    state = serializers.CharField(max_length=16)


class HeartbeatSerializer(StrictSerializer):
    samples = serializers.ListField(child=serializers.DictField(), max_length=256, default=list)
    jobs = JobKeySerializer(many=True, default=list)


class HeartbeatView(AgentView):
    @extend_schema(request=HeartbeatSerializer, responses=inline_serializer("HeartbeatAnswer", {
        "drain": serializers.BooleanField(), "stop": serializers.ListField(child=serializers.DictField())}))
    def post(self, request):
        data = HeartbeatSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(agent_heartbeat(node=self.node, **data.validated_data))


class AttemptSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0)


class ConfirmView(AgentView):
    @extend_schema(request=AttemptSerializer, responses=inline_serializer("Confirmed", {
        "spec": serializers.DictField()}))
    def post(self, request, job_id):
        data = AttemptSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"spec": job_confirm(node=self.node, job_id=job_id, **data.validated_data)})


AGENT_EVENT_STATES = ["starting", "running", "succeeded", "failed", "timeout", "oom", "cancelled"]


class ScrubFailureSerializer(StrictSerializer):
    gpu_index = serializers.IntegerField(min_value=0, max_value=1023)
    message = serializers.CharField(max_length=500)


class EventSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0)
    state = serializers.ChoiceField(choices=AGENT_EVENT_STATES)
    exit_code = serializers.IntegerField(required=False, allow_null=True, default=None)
    message = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")
    # GPUs the agent could not clear after this job: the portal takes them out of service.
    scrub_failures = ScrubFailureSerializer(many=True, required=False, default=list, max_length=64)
    # Something about the node that must stop new work there (a sandbox that could not be killed).
    node_problem = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class EventView(AgentView):
    @extend_schema(request=EventSerializer, responses=inline_serializer("EventApplied", {
        "result": serializers.CharField()}))
    def post(self, request, job_id):
        data = EventSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"result": job_report(node=self.node, job_id=job_id, **data.validated_data)})


class LogSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0)
    offset = serializers.IntegerField(min_value=0)
    data = serializers.CharField(allow_blank=True, trim_whitespace=False, max_length=4 * 1024 * 1024)


class LogView(AgentView):
    @extend_schema(request=LogSerializer, responses=inline_serializer("LogStored", {
        "stored": serializers.BooleanField()}))
    def post(self, request, job_id):
        data = LogSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"stored": job_append_log(node=self.node, job_id=job_id, **data.validated_data)})
