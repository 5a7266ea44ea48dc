"""The job spec (docs/design.md section 4): parsing and every rule a submit is checked against.

Field-level rules live in the serializers; rules that need the project's quota are in
`JobSpecSerializer.validate`, so every message names its field and the limit.
"""
import re
from collections.abc import Mapping
from fnmatch import fnmatchcase
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Count
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.fields import SkipField

from agents.protocol import DEFAULT_SANDBOX, JOB_SANDBOXES, RESERVED_ENV_PREFIXES, is_reserved_env
from portal.core.api import StrictCharField, StrictSerializer
from portal.core.text import plain_name
from portal.nodes.models import GPU

from . import submit_hooks
from .models import Priority

# A gang this wide is a typo, not a job.
MAX_NODES = 256
# Fractions a shared GPU is cut into; anything else would fragment it.
SHARED_GPU_FRACTIONS = (Decimal("0.125"), Decimal("0.25"), Decimal("0.5"))
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# [registry[:port]/]path[:tag][@sha256:digest]: a private registry is often on a port of its own.
IMAGE = re.compile(r"^([a-z0-9][a-z0-9.-]{0,252}:[0-9]{1,5}/)?[a-z0-9][a-z0-9._/-]{0,200}(:[A-Za-z0-9._-]{1,128})?"
                   r"(@sha256:[0-9a-f]{64})?$")
ARRAY = re.compile(r"^(?P<items>\d{1,7}(-\d{1,7})?(,\d{1,7}(-\d{1,7})?)*)(%(?P<limit>\d{1,6}))?$")
DURATION = re.compile(r"^(?:(?P<d>\d+)-)?(?:(?P<h>\d+):)?(?P<m>\d+):(?P<s>\d+)$")
UNIT_DURATION = re.compile(r"^(?P<n>\d+)(?P<u>[smhd])$")


def single_line_value(value: str) -> None:
    """An env value is one line of text: NUL cannot pass through execve, and a newline would
    let a value forge further variables wherever the environment is written out as lines."""
    if "\x00" in value or "\n" in value or "\r" in value:
        raise serializers.ValidationError("A value may not hold NUL or line breaks.")


def parse_array(text: str) -> tuple[list[int], int | None]:
    """'0-99%10' -> ([0..99], 10). Raises ValueError with a message for people."""
    match = ARRAY.match(text.replace(" ", ""))
    if not match:
        raise ValueError("Use ranges like '0-99', lists like '1,3,5', and an optional '%N' limit.")
    indexes: list[int] = []
    max_tasks = settings.JOB_ARRAY_MAX_TASKS
    for part in match["items"].split(","):
        lo, _, hi = part.partition("-")
        lo_i, hi_i = int(lo), int(hi or lo)
        if hi_i < lo_i:
            raise ValueError(f"Range {part} runs backwards.")
        if hi_i - lo_i + 1 + len(indexes) > max_tasks:
            raise ValueError(f"An array has at most {max_tasks} tasks.")
        indexes.extend(range(lo_i, hi_i + 1))
    if len(set(indexes)) != len(indexes):
        raise ValueError("Array indexes repeat.")
    limit = int(match["limit"]) if match["limit"] else None
    if limit == 0:
        raise ValueError("The '%N' limit must be at least 1.")
    return sorted(indexes), limit


def parse_duration(value) -> int:
    """Seconds from 3600, '3600', '90m', '2h', '1d', 'HH:MM:SS' or Slurm's 'D-HH:MM:SS'."""
    if isinstance(value, bool):
        raise ValueError("Expected seconds or a duration like '2h' or '1-00:00:00'.")
    if isinstance(value, int):
        seconds = value
    elif isinstance(value, str) and value.isdigit():
        seconds = int(value)
    elif isinstance(value, str) and (m := UNIT_DURATION.match(value.strip())):
        seconds = int(m["n"]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m["u"]]
    elif isinstance(value, str) and (m := DURATION.match(value.strip())):
        seconds = int(m["d"] or 0) * 86400 + int(m["h"] or 0) * 3600 + int(m["m"]) * 60 + int(m["s"])
    else:
        raise ValueError("Expected seconds or a duration like '2h' or '1-00:00:00'.")
    if seconds <= 0:
        raise ValueError("Must be longer than 0 seconds.")
    return seconds


@extend_schema_field({"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "example": "1-00:00:00"}]})
class DurationField(serializers.Field):
    def to_internal_value(self, data):
        try:
            return parse_duration(data)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def to_representation(self, value):
        return value


class VolumeMountSerializer(StrictSerializer):
    """One of the project's volumes, mounted at /data/<name> (portal.storage)."""

    name = serializers.CharField(max_length=50)
    read_only = serializers.BooleanField(default=False)


PORT_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
MAX_PORTS = 8


class PortSerializer(StrictSerializer):
    """A port the job publishes as an interactive session (docs/sessions.md), proxied by the portal at
    /sessions/<job id>/<name>/."""

    name = serializers.CharField(max_length=32, help_text="Lower-case letters, digits and '-', e.g. 'lab'.")
    port = serializers.IntegerField(min_value=1024, max_value=65535, required=False, allow_null=True, default=None,
                                    help_text="The port the app listens on inside the job (http; jupyter and "
                                              "terminal need none).")
    kind = serializers.ChoiceField(choices=["jupyter", "http", "terminal"])

    def validate_name(self, value):
        if not PORT_NAME.match(value):
            raise serializers.ValidationError("Use lower-case letters, digits and '-', starting with a letter.")
        return value

    def validate(self, data):
        if data["kind"] == "http" and data.get("port") is None:
            raise serializers.ValidationError({"port": ["An http session needs the port its app listens on."]})
        return data


# Signals a job may ask to get before it is stopped: the ones a program traps to save its state
# (SIGUSR1 as Slurm's --signal uses it). SIGKILL and SIGSTOP cannot be trapped.
CHECKPOINT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP")


class CheckpointSerializer(StrictSerializer):
    """The job saves its state to GPUPORTAL_CHECKPOINT_DIR when sent `signal` (and every `interval_s`
    of its run, if it says so) and resumes from it."""

    signal = serializers.ChoiceField(choices=CHECKPOINT_SIGNALS, default="SIGUSR1",
                                     help_text="Sent to the job when it must stop (preemption, migration, node "
                                               "drain, GPU fault; and grace_s before its time limit).")
    grace_s = serializers.IntegerField(min_value=1, default=120,
                                       help_text="Seconds it gets to save after the signal before it is stopped "
                                                 "(at most CHECKPOINT_MAX_GRACE_S, and under its time limit).")

    interval_s = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None,
                                         help_text="The job also saves on its own every this many seconds of "
                                                   "its run (told so in GPUPORTAL_CHECKPOINT_INTERVAL_S): a stop "
                                                   "it gets no signal for loses at most that much work. Omitted: it "
                                                   "saves only when signalled.")

    def validate_grace_s(self, value):
        if value > settings.CHECKPOINT_MAX_GRACE_S:
            raise serializers.ValidationError(f"At most {settings.CHECKPOINT_MAX_GRACE_S} seconds.")
        return value


class ResourcesSerializer(StrictSerializer):
    # gpus defaults to nodes x gpus_per_node, else 0 (a CPU-only job); see validate().
    gpus = serializers.DecimalField(max_digits=6, decimal_places=3, min_value=Decimal(0), required=False,
                                    help_text="All GPUs of the job (default: nodes x gpus_per_node, else 0).")
    nodes = serializers.IntegerField(min_value=1, max_value=MAX_NODES, default=1,
                                     help_text="Nodes the job spans (Slurm's --nodes); above 1 it runs as one "
                                               "gang with gpus_per_node GPUs on each node.")
    gpus_per_node = serializers.IntegerField(min_value=1, max_value=1024, required=False,
                                             help_text="GPUs on each node (Slurm's --gpus-per-node).")
    gpu_type = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    gpu_memory_mb = serializers.IntegerField(min_value=0, max_value=10_000_000, default=0)
    cpus = serializers.DecimalField(max_digits=6, decimal_places=2, min_value=Decimal("0.1"),
                                    max_value=Decimal(1024), default=Decimal(1))
    memory_mb = serializers.IntegerField(min_value=64, max_value=16 * 1024 * 1024, default=4096)

    def validate_gpus(self, value):
        if value >= 1 and value != value.to_integral_value():
            raise serializers.ValidationError("Whole GPUs are counted in integers; use 1, 2, ... or a fraction.")
        if 0 < value < 1 and value not in SHARED_GPU_FRACTIONS:
            sizes = ", ".join(str(f.normalize()) for f in SHARED_GPU_FRACTIONS)
            raise serializers.ValidationError(f"A fraction of a GPU must be one of the shared sizes {sizes}.")
        return value

    def validate(self, data):
        nodes, per = data["nodes"], data.pop("gpus_per_node", None)
        if "gpus" not in data:
            data["gpus"] = Decimal(per * nodes) if per is not None else Decimal(0)
        elif per is not None and data["gpus"] != per * nodes:
            raise serializers.ValidationError({"gpus": [
                f"{data['gpus'].normalize()} is not nodes x gpus_per_node = {nodes} x {per}; give one of them "
                f"or make them agree."]})
        if nodes > 1:
            # A gang is whole GPUs split evenly: a shared fraction or a CPU-only job runs on one node.
            if data["gpus"] < 1:
                raise serializers.ValidationError({"nodes": [
                    "A job on several nodes needs whole GPUs on each; fractional and CPU-only jobs use one node."]})
            if data["gpus"] % nodes:
                raise serializers.ValidationError({"gpus": [
                    f"{data['gpus'].normalize()} GPUs do not split evenly over {nodes} nodes; ask for "
                    f"gpus_per_node instead."]})
        if data["gpus"] == 0 and data["gpu_type"]:
            raise serializers.ValidationError({"gpu_type": ["A GPU type needs gpus of at least a fraction."]})
        if data["gpu_memory_mb"] and not 0 < data["gpus"] < 1:
            raise serializers.ValidationError({"gpu_memory_mb": ["gpu_memory_mb applies to fractional GPUs only."]})
        return data


def _cluster_fit(res: dict, known: dict | None = None) -> dict[str, list[str]]:
    """Field errors when no node set of the cluster could ever hold the job: more nodes than
    there are, or more GPUs per node than the largest has (of the asked type). A cluster with no
    such node yet refuses nothing: its jobs wait until nodes register. `known` keeps the node
    sizes by GPU type for the next call (a batch submit reads them once)."""
    nodes, per = res["nodes"], int(res["gpus"]) // res["nodes"]
    if nodes == 1 and per <= 1:
        return {}  # every node with a GPU holds one: nothing to read
    known = {} if known is None else known
    if res["gpu_type"] not in known:
        gpus = GPU.objects.all()
        if res["gpu_type"]:
            gpus = gpus.filter(model=res["gpu_type"])
        known[res["gpu_type"]] = sorted(
            gpus.values("node_id").annotate(n=Count("id")).values_list("n", flat=True).order_by(), reverse=True)
    sizes = known[res["gpu_type"]]
    if not sizes:
        return {}  # no node yet, or none of this type (the scheduler then says gpu_type)
    kind = f"{res['gpu_type']} " if res["gpu_type"] else ""
    if nodes > len(sizes):
        return {"resources.nodes": [f"{nodes} exceeds the {len(sizes)} node(s) with {kind}GPUs in the cluster."]}
    if per > sizes[0]:
        if nodes == 1:
            return {"resources.gpus": [
                f"{per} GPUs on one node, but the largest node has {sizes[0]} {kind}GPUs; to span nodes ask for "
                f"nodes and gpus_per_node (e.g. nodes {-(-per // sizes[0])})."]}
        return {"resources.gpus_per_node": [f"{per} exceeds the largest node's {sizes[0]} {kind}GPUs."]}
    if sizes[nodes - 1] < per:
        return {"resources.nodes": [f"Only {sum(1 for k in sizes if k >= per)} node(s) have {per} {kind}GPUs."]}
    return {}


def image_allowed(image: str, patterns: list[str]) -> bool:
    """Whether a project whose quota lists `patterns` may run `image`: no patterns means any
    image; otherwise the reference must match one, exactly or as a shell-style pattern
    (`registry.example.org/team/*`; `*` also matches `/`, case counts)."""
    return not patterns or any(fnmatchcase(image, pattern) for pattern in patterns)


class JobSpecSerializer(StrictSerializer):
    """A submit after any template is merged in. context: project (with quota)."""

    project = serializers.CharField(max_length=50)
    template = serializers.CharField(max_length=100, required=False, allow_blank=True)
    name = serializers.CharField(max_length=200, validators=[plain_name], required=False,
                                 help_text="Default: the command's program (its basename), as gpuctl does.")
    image = serializers.CharField(max_length=400)
    command = serializers.ListField(child=StrictCharField(max_length=8192, allow_blank=True, trim_whitespace=False),
                                    min_length=1, max_length=1024)
    env = serializers.DictField(child=StrictCharField(max_length=32768, allow_blank=True, trim_whitespace=False,
                                                      validators=[single_line_value]),
                                required=False, default=dict)
    resources = ResourcesSerializer(required=False)
    time_limit = DurationField(required=False)
    priority = serializers.ChoiceField(choices=Priority.choices, default=Priority.NORMAL)
    preemptible = serializers.BooleanField(default=False)
    do_not_disrupt = serializers.BooleanField(
        default=False, help_text="Never move this job to consolidate nodes before releasing one (docs/autoscaling.md).")
    sandbox = serializers.ChoiceField(choices=JOB_SANDBOXES, default=DEFAULT_SANDBOX)
    network = serializers.BooleanField(default=False)
    array = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    depends_on = serializers.ListField(child=serializers.IntegerField(min_value=1), required=False, default=list,
                                       max_length=100)
    volumes = serializers.ListField(child=VolumeMountSerializer(), required=False, default=list, max_length=16,
                                    help_text="The project's volumes to mount at /data/<name>.")
    datasets = serializers.ListField(
        child=serializers.CharField(max_length=80), required=False, default=list, max_length=16,
        help_text="The project's datasets to read at /datasets/<name>: 'name@version', or 'name' for its latest "
                  "ready version; resolved at submit to {name, version, digest, size, source}.")
    checkpoint = CheckpointSerializer(required=False, allow_null=True, default=None,
                                      help_text="The job checkpoints: stopped for preemption, migration, a node "
                                                "drain or a GPU fault it gets `signal` and `grace_s` to save, and "
                                                "its next attempt resumes from GPUPORTAL_CHECKPOINT_DIR.")
    ports = serializers.ListField(child=PortSerializer(), required=False, default=list, max_length=MAX_PORTS,
                                  help_text="Interactive sessions the job publishes: JupyterLab, a terminal or "
                                            "an HTTP app, proxied by the portal (docs/sessions.md).")

    def validate_image(self, value):
        if not IMAGE.match(value):
            raise serializers.ValidationError("Not an image reference like 'registry/name:tag'.")
        return value

    def validate_env(self, value):
        if len(value) > 256:
            raise serializers.ValidationError("At most 256 variables.")
        for name in value:
            if not ENV_NAME.match(name):
                raise serializers.ValidationError(f"{name!r} is not a valid variable name.")
            # The agent drops these again (agents/protocol.py is the one list); refusing them here
            # says so at submit instead of dropping them silently.
            if is_reserved_env(name):
                raise serializers.ValidationError(
                    f"{name} is reserved: the portal sets {', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)} "
                    "and the rendezvous variables itself.")
        return value

    def validate_ports(self, value):
        names, ports = set(), set()
        for item in value:
            if item["name"] in names:
                raise serializers.ValidationError(f"Session name {item['name']!r} is used twice.")
            if item.get("port") is not None and item["port"] in ports:
                raise serializers.ValidationError(f"Port {item['port']} is published twice.")
            names.add(item["name"])
            ports.add(item.get("port"))
        if sum(1 for item in value if item["kind"] == "jupyter") > 1:
            raise serializers.ValidationError("A job runs at most one JupyterLab.")
        return value

    def validate_array(self, value):
        if not value:
            return value
        try:
            parse_array(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value

    def to_internal_value(self, data):
        """Every problem of a request in one answer: DRF stops at the first failing stage
        (unknown keys, then fields, then validate()), so on any error the fields not yet
        blamed are checked one by one and the project's rules run on those that pass."""
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if not isinstance(exc.detail, dict) or not isinstance(data, Mapping):
                raise
            errors = dict(exc.detail)
            passed = {}
            for name, field in self.fields.items():
                if name in errors or field.read_only:
                    continue
                try:
                    value = field.run_validation(field.get_value(data))
                    if (check := getattr(self, f"validate_{name}", None)) is not None:
                        value = check(value)
                except serializers.ValidationError as field_exc:
                    errors[name] = field_exc.detail
                    continue
                except SkipField:
                    continue
                passed[name] = value
            if not any(k == "resources" or k.startswith("resources.") for k in errors):
                passed.setdefault("resources", ResourcesSerializer().run_validation({}))
            for key, messages in self.project_rules(passed).items():
                errors.setdefault(key, messages)
            raise serializers.ValidationError(errors) from None

    def validate(self, data):
        """Rules that need the project's quota; a missing name is the command's program."""
        if "resources" not in data:
            data["resources"] = ResourcesSerializer().run_validation({})
        errors = self.project_rules(data)
        if errors:
            raise serializers.ValidationError(errors)
        if not data.get("name"):
            data["name"] = default_name(data["command"])
        return data

    def project_rules(self, data: dict) -> dict[str, list[str]]:
        """Field errors from the project's quota, for the fields present in `data` (all of them
        on a valid request; those that passed their own checks on an invalid one). Sets the
        default time limit."""
        project = self.context.get("project")
        if project is None:
            return {}  # the project itself was refused: nothing to measure against
        quota = project.quota
        errors: dict[str, list[str]] = {}
        if "image" in data and not image_allowed(data["image"], quota.allowed_images):
            errors["image"] = [f"{data['image']} is not an allowed image for this project; allowed: "
                               f"{', '.join(quota.allowed_images)}."]
        res = data.get("resources")
        if res is not None:
            if res["gpus"] > quota.max_gpus:
                errors["resources.gpus"] = [f"{res['gpus'].normalize()} exceeds the project limit of "
                                            f"{quota.max_gpus.normalize()}."]
            if res["gpu_type"] and quota.allowed_gpu_types and res["gpu_type"] not in quota.allowed_gpu_types:
                errors["resources.gpu_type"] = [f"{res['gpu_type']} is not allowed here; allowed: "
                                                f"{', '.join(quota.allowed_gpu_types)}."]
            if res["gpus"] >= 1 and not any(k.startswith("resources.") for k in errors):
                errors.update(_cluster_fit(res, self.context.get("gpu_sizes")))
        limit = data.get("time_limit") or min(settings.JOB_DEFAULT_TIME_LIMIT_S, quota.max_time_limit_s)
        if limit > quota.max_time_limit_s:
            errors["time_limit"] = [f"{limit} s exceeds the project maximum of {quota.max_time_limit_s} s."]
        data["time_limit"] = limit
        checkpoint = data.get("checkpoint")
        if checkpoint and checkpoint["grace_s"] >= limit:
            errors["checkpoint.grace_s"] = [f"{checkpoint['grace_s']} s is not under the job's time limit of {limit} s."]
        if data.get("network") and not quota.network_allowed:
            errors["network"] = ["This project does not allow network access for jobs."]
        for check in submit_hooks.spec_checks.values():  # volumes and datasets (storage)
            errors.update(check(project, data))
        if data.get("ports"):
            if data.get("array"):
                errors["ports"] = ["An array's tasks cannot publish sessions; submit one job per session."]
            elif res is not None and res["nodes"] > 1:
                errors["ports"] = ["A job on several nodes cannot publish sessions yet; use one node."]
            elif data.get("sandbox") == "kvm" and any(p.get("kind") != "terminal" for p in data["ports"]):
                errors["ports"] = ["The kvm sandbox publishes a terminal only (kind terminal); use the docker "
                                   "sandbox for JupyterLab and HTTP apps."]
        return errors


def default_name(command: list[str]) -> str:
    """The name gpuctl gives a job without one: its program's basename ("python" for
    ["/usr/bin/python", "train.py"]); "job" when that is empty or not a plain name."""
    name = str(command[0]).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1][:200] if command else ""
    try:
        plain_name(name)
    except DjangoValidationError:
        return "job"
    return name.strip() or "job"
