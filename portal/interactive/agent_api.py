"""The agent's session report: POST /api/agent/v1/jobs/<id>/sessions (node token only)."""
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response

from portal.core.api import StrictSerializer
from portal.core.errors import Conflict
from portal.jobs.reports import _load, job_nodes
from portal.nodes.agent_api import MAX_ATTEMPT, AgentView

from .services import session_report


class SessionReportSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0, max_value=MAX_ATTEMPT)
    name = serializers.CharField(max_length=32)
    state = serializers.ChoiceField(choices=["starting", "running", "ended"])
    # Where the portal's proxy reaches this node's session gateway (agents/sessions.py).
    gateway_url = serializers.RegexField(r"^https?://[A-Za-z0-9.\[\]:_-]+(/[A-Za-z0-9._~/-]*)?$", max_length=300,
                                         required=False, allow_blank=True, default="")
    message = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")

    def validate(self, data):
        if data["state"] == "running" and not data["gateway_url"]:
            raise serializers.ValidationError({"gateway_url": ["A running session needs the gateway's URL."]})
        return data


class SessionReportView(AgentView):
    @extend_schema(request=SessionReportSerializer, responses=inline_serializer("SessionReported", {
        "state": serializers.CharField()}))
    def post(self, request, job_id):
        data = SessionReportSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        job = _load(job_id, v["attempt"], self.node)
        if self.node.name not in job_nodes(job):
            raise Conflict(f"Job {job_id} does not run on {self.node.name}.", code="stale")
        session = session_report(node=self.node, job=job, attempt=v["attempt"], name=v["name"], state=v["state"],
                                 gateway_url=v["gateway_url"], message=v["message"])
        if session is None:
            raise Conflict(f"Job {job_id} publishes no session {v['name']!r}.", code="stale")
        return Response({"state": session.state})
