"""The agent API's node reports, /api/agent/v1/: register, probe, and the heartbeat's checks (the fast path and its serializers); AgentView and
the bounds every agent report shares. The heartbeat itself and job reports (confirm, events, logs) are in
portal/agentapi/, above jobs; portal/agentapi/urls.py puts all of them under one URL prefix.

Only node tokens (gpn_...) authenticate here, and a node token authenticates nowhere else.
409 means "stale": the agent must stop that attempt and start nothing for it.
"""
import re

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from drf_spectacular.utils import extend_schema, extend_schema_field, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import protocol
from agents.protocol import NODE_SANDBOXES, PROTOCOL_VERSION, protocol_major
from portal.core.api import StrictSerializer
from portal.core.errors import flatten

from .auth import IsNode, NodeTokenAuthentication
from .services import agent_probe_answer, agent_register


class AgentView(APIView):
    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNode]
    throttle_classes = []  # a fleet heartbeats constantly; node tokens are the gate

    @property
    def node(self):
        return self.request.auth


# Bounds on every number an agent reports: far above any real machine, far below what a
# column holds, so a buggy or hostile agent gets a 400 naming the field, never a 500 (and a
# value that would break a later batch write never gets in).
MAX_GPUS = 256
MAX_GPU_MEMORY_MB = 1024 * 1024  # 1 TiB per GPU
MAX_NODE_MEMORY_MB = 64 * 1024 * 1024  # 64 TiB per node
MAX_CPUS = 4096
MAX_ATTEMPT = 2**31 - 1
MAX_INT32 = 2**31 - 1
# NVML's "GPU-<uuid>" and "MIG-..." names; "gone-" is what the portal itself writes.
GPU_UUID = r"^(?!gone-)[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}$"
CAPABILITY = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


def cached_datasets_field():
    """The digests in the node's dataset cache (agents/datasets.py), as Node.cached_datasets keeps them."""
    return serializers.ListField(child=serializers.RegexField(r"^[0-9a-f]{64}$", max_length=64), required=False,
                                 allow_null=True, default=None, max_length=protocol.CACHED_DATASETS_MAX,
                                 help_text="sha256 digests of the dataset versions the node's cache holds.")


def speaks(message: protocol.Message):
    """The serializer of one of agents.protocol's messages: it must declare exactly the message's
    keys, the required ones required, or the portal does not start (the contract is written once)."""
    def check(cls):
        declared = cls._declared_fields
        wrong = sorted(name for name, field in declared.items()
                       if name in message.fields and field.required != (name in message.required))
        if set(declared) != set(message.fields) or wrong:
            raise ImproperlyConfigured(
                f"{cls.__name__} declares {sorted(declared)}, agents.protocol's message {sorted(message.fields)} "
                f"(required {list(message.required)}; required here or there only: {wrong})")
        cls.message = message
        return cls
    return check


class GpuTopologySerializer(StrictSerializer):
    # A domain id per level (agents/probe: the lowest GPU index in it, or the NUMA node); null: unknown.
    nvlink = serializers.IntegerField(min_value=0, max_value=MAX_INT32, required=False, allow_null=True, default=None)
    pcie = serializers.IntegerField(min_value=0, max_value=MAX_INT32, required=False, allow_null=True, default=None)
    numa = serializers.IntegerField(min_value=0, max_value=MAX_INT32, required=False, allow_null=True, default=None)


@speaks(protocol.GPU_INVENTORY)
class GpuInventorySerializer(StrictSerializer):
    index = serializers.IntegerField(min_value=0, max_value=MAX_GPUS - 1)
    uuid = serializers.RegexField(GPU_UUID, max_length=64)
    model = serializers.CharField(max_length=128)
    memory_mb = serializers.IntegerField(min_value=0, max_value=MAX_GPU_MEMORY_MB)
    pci_bus_id = serializers.CharField(max_length=32, required=False, allow_blank=True, default="")
    topology = GpuTopologySerializer(required=False, allow_null=True, default=None)


@speaks(protocol.REGISTER)
class RegisterSerializer(StrictSerializer):
    name = serializers.CharField(max_length=63)
    cpus = serializers.IntegerField(min_value=0, max_value=MAX_CPUS)
    memory_mb = serializers.IntegerField(min_value=0, max_value=MAX_NODE_MEMORY_MB)
    sandbox = serializers.ChoiceField(choices=NODE_SANDBOXES)
    gpus = GpuInventorySerializer(many=True, max_length=MAX_GPUS)
    capabilities = serializers.DictField(child=serializers.BooleanField(), required=False, default=dict)
    # Why the agent's sandbox cannot give its GPUs to jobs (docker without the NVIDIA runtime); "" = it can.
    gpus_unusable = serializers.CharField(max_length=150, required=False, allow_blank=True, default="")
    # The agent's agents.protocol.PROTOCOL_VERSION; an agent older than the field sends none and speaks 1.x.
    protocol_version = serializers.CharField(max_length=16, required=False, allow_blank=True, default="")
    cached_datasets = cached_datasets_field()

    def validate_protocol_version(self, value):
        if not value:
            return value
        try:
            major = protocol_major(value)
        except ValueError:
            raise serializers.ValidationError(f"{value!r} is not a MAJOR.MINOR version like '1.0'.") from None
        if major != protocol_major(PROTOCOL_VERSION):
            raise serializers.ValidationError(
                f"This portal speaks agent protocol {PROTOCOL_VERSION}; an agent speaking {value} cannot "
                "register. Install the agent that matches this portal.")
        return value

    def validate_gpus(self, gpus):
        # Two entries for one index or one UUID would write one GPU twice (a unique-key 500).
        for key in ("index", "uuid"):
            seen = set()
            for position, gpu in enumerate(gpus):
                if gpu[key] in seen:
                    raise serializers.ValidationError({position: {key: [f"GPU {key} {gpu[key]} appears twice."]}})
                seen.add(gpu[key])
        return gpus

    def validate_capabilities(self, capabilities):
        if len(capabilities) > 64:
            raise serializers.ValidationError("At most 64 capabilities.")
        for key in capabilities:
            if not re.match(CAPABILITY, key):
                raise serializers.ValidationError(f"{key[:70]!r} is not a capability name (lowercase, at most 64).")
        return capabilities


class RegisterView(AgentView):
    @extend_schema(request=RegisterSerializer, responses=inline_serializer("Registered", {
        "node": serializers.CharField(), "heartbeat_interval_s": serializers.FloatField(),
        "lease_s": serializers.FloatField(), "fence_grace_s": serializers.FloatField(),
        "protocol_version": serializers.CharField()}))
    def post(self, request):
        data = RegisterSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = dict(data.validated_data)
        node = agent_register(node=self.node, **fields)
        # The agent stops its sandboxes when no heartbeat was answered for lease_s (SIGTERM, then
        # SIGKILL after fence_grace_s): NODE_TIMEOUT_S covers both (portal/settings.py).
        return Response({"node": node.name, "heartbeat_interval_s": settings.NODE_HEARTBEAT_INTERVAL_S,
                         "lease_s": settings.AGENT_LEASE_S, "fence_grace_s": settings.AGENT_FENCE_GRACE_S,
                         "protocol_version": PROTOCOL_VERSION})


@speaks(protocol.PROBE)
class ProbeSerializer(StrictSerializer):
    nonce = serializers.RegexField(r"^[0-9a-f]{32}$", max_length=32)


class ProbeView(AgentView):
    """The agent answers the probe the portal put on its queue node.<name> at registration:
    proof that it receives its commands, after which the node takes jobs."""

    @extend_schema(request=ProbeSerializer, responses=inline_serializer("ProbeAnswered", {
        "result": serializers.CharField()}))
    def post(self, request):
        data = ProbeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"result": agent_probe_answer(node=self.node, **data.validated_data)})


@speaks(protocol.HEARTBEAT_JOB)
class JobKeySerializer(serializers.Serializer):
    job_id = serializers.CharField(max_length=32)
    attempt = serializers.IntegerField(min_value=0, max_value=MAX_ATTEMPT)
    state = serializers.CharField(max_length=16)


@extend_schema_field({"oneOf": [{"type": "number", "minimum": 0, "maximum": 1e11}, {"type": "string", "maxLength": 40}]})
class TimestampField(serializers.Field):
    """Epoch seconds or an ISO 8601 string; the ingest puts a skewed or unreadable one at now."""

    def to_internal_value(self, data):
        if isinstance(data, (int, float)) and not isinstance(data, bool) and 0 <= data <= 1e11:
            return data
        if isinstance(data, str) and len(data) <= 40:
            return data
        raise serializers.ValidationError("Expected epoch seconds (0 to 1e11) or an ISO 8601 string.")

    def to_representation(self, value):
        return value


class NumberField(serializers.FloatField):
    """A JSON number within bounds, kept as the agent sent it (42 stays 42 on the live tiles)."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise serializers.ValidationError("Expected a number.")
        super().to_internal_value(data)  # the bounds
        return data


class XidListField(serializers.ListField):
    """A list of Xid codes, or one bare code, or null (older agents send either)."""

    def to_internal_value(self, data):
        if data is None:
            return []
        return super().to_internal_value(data if isinstance(data, list) else [data])


class ProcessSerializer(serializers.Serializer):
    pid = serializers.IntegerField(min_value=0, max_value=MAX_INT32)
    used_memory_mb = serializers.IntegerField(min_value=0, max_value=MAX_GPU_MEMORY_MB, required=False,
                                              allow_null=True)


def _optional(field_class, **bounds):
    return field_class(required=False, allow_null=True, default=None, **bounds)


@speaks(protocol.SAMPLE)
class SampleSerializer(serializers.Serializer):
    """One NVML reading of one GPU (agents.probe.GpuSample); a figure the GPU cannot give is null.
    Keys this portal does not know are dropped (a newer agent may send more)."""

    gpu_uuid = serializers.RegexField(GPU_UUID, max_length=64)
    ts = _optional(TimestampField)
    utilization = _optional(NumberField, min_value=0, max_value=100)  # percent
    memory_used_mb = _optional(serializers.IntegerField, min_value=0, max_value=MAX_GPU_MEMORY_MB)
    memory_total_mb = _optional(serializers.IntegerField, min_value=0, max_value=MAX_GPU_MEMORY_MB)
    temperature_c = _optional(NumberField, min_value=-100, max_value=250)
    power_w = _optional(NumberField, min_value=0, max_value=10_000)
    power_limit_w = _optional(NumberField, min_value=0, max_value=10_000)
    ecc_errors = _optional(serializers.IntegerField, min_value=0, max_value=MAX_INT32)
    # Xid codes seen since the last sample that got through: many after a long outage.
    xid_errors = XidListField(child=serializers.IntegerField(min_value=0, max_value=MAX_INT32), max_length=1024,
                              required=False, allow_null=True, default=list)
    processes = ProcessSerializer(many=True, required=False, default=list, max_length=256)


@extend_schema_field(SampleSerializer(many=True))
class SampleListField(serializers.ListField):
    """Samples are checked one by one in the view: a bad one is refused alone, never the batch."""

    child = serializers.DictField()


def samples_check(samples: list[dict]) -> tuple[list[dict], list[int], list[dict]]:
    """The samples that pass SampleSerializer with their positions in the batch, and
    [{position, gpu_uuid, errors}] for the rest."""
    good, positions, refused = [], [], []
    # One serializer for the batch: building one per sample deep-copies its fields each time (a
    # third of a heartbeat's CPU); its fields keep no state between calls (the items are dicts,
    # SampleListField's children, so is_valid's null-data case cannot arise).
    checker = SampleSerializer()
    for position, sample in enumerate(samples):
        try:
            good.append(dict(checker.run_validation(sample)))
            positions.append(position)
        except serializers.ValidationError as exc:
            uuid = sample.get("gpu_uuid")
            refused.append({"position": position, "gpu_uuid": uuid if isinstance(uuid, str) else None,
                            "errors": flatten(exc.detail)})
    return good, positions, refused


@speaks(protocol.HEARTBEAT)
class HeartbeatSerializer(StrictSerializer):
    samples = SampleListField(max_length=256, default=list)
    jobs = JobKeySerializer(many=True, default=list, max_length=4096)
    cached_datasets = cached_datasets_field()  # sent when it changed; absent: as before


# The heartbeat's fast path (docs/design.md section 10): a body of plain, well-formed values, as
# every agent sends, is checked here by hand and gives exactly what the serializers above would
# give; anything else (a wrong type, a bound crossed, an unknown key, a string where a number
# goes, NUL) returns None and the serializers decide, with their messages. Nothing is accepted
# here that they would refuse: tests/nodes/test_heartbeat_fast.py compares both on many bodies.
_UUID = re.compile(GPU_UUID[1:-1])  # fullmatch: no trailing newline either
_SAMPLE_KEYS = frozenset(SampleSerializer._declared_fields)
_PROCESS_KEYS = frozenset(ProcessSerializer._declared_fields)
_JOB_KEYS = frozenset(JobKeySerializer._declared_fields)
# (name, whether a float is taken, bounds): the optional numbers of SampleSerializer, in its order.
_SAMPLE_NUMBERS = (("utilization", True, 0, 100), ("memory_used_mb", False, 0, MAX_GPU_MEMORY_MB),
                   ("memory_total_mb", False, 0, MAX_GPU_MEMORY_MB), ("temperature_c", True, -100, 250),
                   ("power_w", True, 0, 10_000), ("power_limit_w", True, 0, 10_000),
                   ("ecc_errors", False, 0, MAX_INT32))
_MISSING = object()


def _plain_text(value, max_length: int) -> bool:
    # What a CharField keeps as it is: a non-blank string, no NUL, no whitespace to trim.
    return (type(value) is str and 0 < len(value) <= max_length and "\x00" not in value
            and value == value.strip())


def _sample_fast(s) -> dict | None:
    if type(s) is not dict or not s.keys() <= _SAMPLE_KEYS:
        return None
    uuid = s.get("gpu_uuid")
    if type(uuid) is not str or not _UUID.fullmatch(uuid):
        return None
    ts = s.get("ts")
    if not (ts is None or ((type(ts) is int or type(ts) is float) and 0 <= ts <= 1e11)
            or (type(ts) is str and len(ts) <= 40 and "\x00" not in ts)):
        return None
    out = {"gpu_uuid": uuid, "ts": ts}
    for name, real, low, high in _SAMPLE_NUMBERS:
        v = s.get(name)
        if v is not None and not ((type(v) is int or (real and type(v) is float)) and low <= v <= high):
            return None
        out[name] = v
    xids = s.get("xid_errors", _MISSING)
    if xids is _MISSING:
        xids = []
    elif not (type(xids) is list and len(xids) <= 1024
              and all(type(x) is int and 0 <= x <= MAX_INT32 for x in xids)):
        return None
    out["xid_errors"] = list(xids)
    processes = s.get("processes", _MISSING)
    if processes is _MISSING:
        processes = []
    elif type(processes) is not list or len(processes) > 256:
        return None
    out["processes"] = kept = []
    for p in processes:
        if type(p) is not dict or "pid" not in p or not p.keys() <= _PROCESS_KEYS:
            return None
        pid, used = p["pid"], p.get("used_memory_mb")
        if type(pid) is not int or not 0 <= pid <= MAX_INT32 or not (
                used is None or (type(used) is int and 0 <= used <= MAX_GPU_MEMORY_MB)):
            return None
        kept.append(dict(p))
    return out


def heartbeat_fast(data) -> tuple[list[dict], list[dict]] | None:
    """(samples, jobs) as HeartbeatSerializer and samples_check would validate them, for a body
    they would take whole; None for any other (the serializers then decide)."""
    if type(data) is not dict or not data.keys() <= {"samples", "jobs"}:
        return None
    samples, jobs = data.get("samples", []), data.get("jobs", [])
    if type(samples) is not list or len(samples) > 256 or type(jobs) is not list or len(jobs) > 4096:
        return None
    good = []
    for s in samples:
        checked = _sample_fast(s)
        if checked is None:
            return None
        good.append(checked)
    keys = []
    for j in jobs:
        if type(j) is not dict or j.keys() != _JOB_KEYS:
            return None
        job_id, attempt, state = j["job_id"], j["attempt"], j["state"]
        if not (_plain_text(job_id, 32) and _plain_text(state, 16) and type(attempt) is int
                and 0 <= attempt <= MAX_ATTEMPT):
            return None
        keys.append({"job_id": job_id, "attempt": attempt, "state": state})
    return good, keys
