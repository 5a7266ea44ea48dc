"""Job reports an agent sends: may it start an attempt (confirm), what became of it (events),
and what it printed (logs). 409 means "stale": the agent must stop that attempt."""
import base64
import binascii

from django.core.validators import ProhibitNullCharactersValidator
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response

from agents import protocol
from agents.protocol import EVENT_STATES
from portal.core.api import StrictSerializer, validated
from portal.core.numbers import parse_int
from portal.jobs.reports import job_append_log, job_confirm, job_confirm_many, job_report, job_report_many
from portal.launch import confirmed_launch_specs, launch_spec
from portal.nodes.agent_api import MAX_ATTEMPT, MAX_INT32, AgentView, speaks


@speaks(protocol.CONFIRM)
class AttemptSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0, max_value=MAX_ATTEMPT)


class ConfirmView(AgentView):
    @extend_schema(request=AttemptSerializer, responses=inline_serializer("Confirmed", {
        "spec": serializers.DictField()}))
    def post(self, request, job_id):
        data = validated(AttemptSerializer, request.data)
        job = job_confirm(node=self.node, job_id=job_id, **data)
        return Response({"spec": launch_spec(job.pk, self.node.name, attempt=data["attempt"])})


@speaks(protocol.BATCH_CONFIRM)
class BatchConfirmSerializer(AttemptSerializer):
    """One confirmation of a batch: a launch's attempt with its job id (protocol 1.7)."""

    job_id = serializers.CharField(max_length=64)  # one the portal does not know is answered stale


@speaks(protocol.CONFIRMS)
class ConfirmsSerializer(StrictSerializer):
    confirms = BatchConfirmSerializer(many=True, allow_empty=False, max_length=protocol.EVENTS_MAX)


class ConfirmsView(AgentView):
    """Several launches' confirmations in one request (protocol 1.7): a node's launches of one pass."""

    @extend_schema(request=ConfirmsSerializer, responses=inline_serializer("ConfirmsApplied", {
        "results": inline_serializer("ConfirmResult", {
            "job_id": serializers.CharField(),
            "result": serializers.ChoiceField(choices=["confirmed", "stale"],
                                              help_text="stale: the 409 of a single confirm; start nothing."),
            "spec": serializers.DictField(required=False, help_text="The launch spec, when confirmed."),
            "detail": serializers.CharField(required=False)}, many=True)}))
    def post(self, request):
        confirms = validated(ConfirmsSerializer, request.data)["confirms"]
        results = job_confirm_many(node=self.node, confirms=confirms)
        attempts = {parse_int(c["job_id"]): c["attempt"] for c, r in zip(confirms, results)
                    if r["result"] == "confirmed"}
        specs = confirmed_launch_specs(self.node.name, attempts)
        for c, r in zip(confirms, results):
            if r["result"] == "confirmed":
                r["spec"] = specs.get(parse_int(c["job_id"])) or {}
        return Response({"results": results})


@speaks(protocol.SCRUB_FAILURE)
class ScrubFailureSerializer(StrictSerializer):
    gpu_index = serializers.IntegerField(min_value=0, max_value=1023)
    message = serializers.CharField(max_length=500)


@speaks(protocol.EVENT)
class EventSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0, max_value=MAX_ATTEMPT)
    state = serializers.ChoiceField(choices=EVENT_STATES)
    exit_code = serializers.IntegerField(min_value=-MAX_INT32 - 1, max_value=MAX_INT32, required=False,
                                         allow_null=True, default=None)
    message = serializers.CharField(max_length=protocol.EVENT_MESSAGE_MAX, required=False, allow_blank=True,
                                    default="")
    # GPUs the agent could not clear after this job: the portal takes them out of service.
    scrub_failures = ScrubFailureSerializer(many=True, required=False, default=list, max_length=64)
    # Something about the node that must stop new work there (a sandbox that could not be killed).
    node_problem = serializers.CharField(max_length=protocol.NODE_PROBLEM_MAX, required=False, allow_blank=True,
                                         default="")
    # The node fenced the attempt because its lease ran out (protocol 1.1): a node fault, requeued.
    lease_expired = serializers.BooleanField(required=False, default=False)
    # The node cannot start this attempt now for want of room it may have later (protocol 1.5: its
    # dataset cache is full of what running jobs read): requeued, no failure counted, kept off the node a while.
    not_startable = serializers.CharField(max_length=protocol.NODE_PROBLEM_MAX, required=False, allow_blank=True,
                                          default="")


class EventView(AgentView):
    @extend_schema(request=EventSerializer, responses=inline_serializer("EventApplied", {
        "result": serializers.CharField()}))
    def post(self, request, job_id):
        data = validated(EventSerializer, request.data)
        return Response({"result": job_report(node=self.node, job_id=job_id, **data)})


@speaks(protocol.BATCH_EVENT)
class BatchEventSerializer(EventSerializer):
    """One event of a batch: a job's report with its job id (protocol 1.2)."""

    job_id = serializers.CharField(max_length=64)  # one the portal does not know is answered stale


@speaks(protocol.EVENTS)
class EventsSerializer(StrictSerializer):
    events = BatchEventSerializer(many=True, allow_empty=False, max_length=protocol.EVENTS_MAX)


class EventsView(AgentView):
    """Several jobs' reports in one request (protocol 1.2), for many jobs ending together."""

    @extend_schema(request=EventsSerializer, responses=inline_serializer("EventsApplied", {
        "results": inline_serializer("EventResult", {
            "job_id": serializers.CharField(),
            "result": serializers.ChoiceField(choices=["applied", "duplicate", "stale"],
                                              help_text="stale: the 409 of a single report; stop that attempt."),
            "detail": serializers.CharField(required=False)}, many=True)}))
    def post(self, request):
        data = validated(EventsSerializer, request.data)
        return Response({"results": job_report_many(node=self.node, events=data["events"])})


@speaks(protocol.LOG)
class LogSerializer(StrictSerializer):
    """A chunk of a sandbox's output: raw bytes as base64 (what the agent sends: a job may print NUL
    or invalid UTF-8), or as text (stored UTF-8 encoded). ``offset`` counts raw bytes."""

    attempt = serializers.IntegerField(min_value=0, max_value=2**31 - 1)
    offset = serializers.IntegerField(min_value=0, max_value=2**53)
    data = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False, max_length=4 * 1024 * 1024)
    data_base64 = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False,
                                        max_length=6 * 1024 * 1024)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Log text may hold NUL: it is stored as bytes, so DRF's refusal of it does not apply.
        field = self.fields["data"]
        field.validators = [v for v in field.validators if not isinstance(v, ProhibitNullCharactersValidator)]

    def validate(self, attrs):
        if ("data" in attrs) == ("data_base64" in attrs):
            raise serializers.ValidationError({"data": ["Send exactly one of data and data_base64."]})
        if "data" in attrs:
            # A lone surrogate (valid JSON, not valid Unicode) becomes "?": the chunk is still kept.
            return {**attrs, "data": attrs["data"].encode("utf-8", errors="replace")}
        try:
            raw = base64.b64decode(attrs.pop("data_base64"), validate=True)
        except (binascii.Error, ValueError):
            raise serializers.ValidationError({"data_base64": ["Not valid base64."]}) from None
        return {**attrs, "data": raw}


class LogView(AgentView):
    @extend_schema(request=LogSerializer, responses=inline_serializer("LogStored", {
        "stored": serializers.BooleanField(help_text="Some of the chunk was new and kept."),
        "size": serializers.IntegerField(help_text="Bytes stored for this attempt."),
        "full": serializers.BooleanField(help_text="The attempt's log reached JOB_LOG_MAX_BYTES: stop sending.")}))
    def post(self, request, job_id):
        data = validated(LogSerializer, request.data)
        return Response(job_append_log(node=self.node, job_id=job_id, **data))
