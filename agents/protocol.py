"""The contract between the portal and its node agents, written once.

Plain Python with no Django and no portal import: the agent imports it, and so do the portal
(the agent API, job submission, report handling) and the scheduler core. A rule both sides must
agree on lives here and nowhere else; tests/core/test_protocol.py fails when a copy reappears.
"""

from __future__ import annotations

from dataclasses import dataclass

# The version of the agent API's message shapes, "MAJOR.MINOR", sent at registration. The portal
# refuses an agent whose major differs (its messages would be misread); a minor adds optional
# fields only. An agent that sends no version predates this field and speaks 1.x.
PROTOCOL_VERSION = "1.7"  # 1.1: a terminal event may say lease_expired; 1.2: POST events takes several at once
# 1.3: register and heartbeat may carry cached_datasets (the digests in the node's dataset cache)
# 1.4: the agent takes agent.launches, a node's launches of one scheduling pass in one message
# 1.5: a failed event may say not_startable: the node could not start the attempt for want of something
#      it may have later or another node has now (its dataset cache full): requeued, not counted as failed
# 1.6: the agent may upload artifacts straight to an S3-compatible storage (presigned PUTs the portal
#      issues per file, then a confirm): POST jobs/<id>/artifacts/uploads and .../artifacts/confirm
# 1.7: POST confirms takes several launches' confirmations at once (the launches of one pass on a node)


def protocol_major(version: str) -> int:
    """The major of a "MAJOR.MINOR" version; ValueError when it is not one."""
    major, sep, minor = version.partition(".")
    if not (sep and major.isdigit() and minor.isdigit()):
        raise ValueError(f"{version!r} is not a MAJOR.MINOR version")
    return int(major)


def speaks(version: str | None, least: tuple[int, int]) -> bool:
    """Whether the other side's "MAJOR.MINOR" version is at least ``least``: False for None or ""
    (a side older than the field) and for a version that is not one."""
    major, sep, minor = str(version or "").partition(".")
    return bool(sep and major.isdigit() and minor.isdigit()) and (int(major), int(minor)) >= least


# -- commands down to the agent (Celery tasks on the node's queue) ---------------------------------

# Since 1.4 a scheduling pass sends each node all its launches in one ``agent.launches`` message,
# args [[job_id, attempt, spec], ...], each as ``agent.launch`` takes it; an agent before 1.4 gets
# one ``agent.launch`` per job.
LAUNCHES_SINCE = (1, 4)

# Since 1.6 the portal may answer an agent's request to upload an artifact with a presigned URL of the
# storage (portal/storage/artifact_direct.py); to older agents it never does (they PUT to the portal).
DIRECT_ARTIFACTS_SINCE = (1, 6)


# -- sandboxes -------------------------------------------------------------------------------------

# What a job may ask for, and what a node's agent may run (``process`` isolates nothing: only for
# machines without Docker, and it takes docker jobs there).
JOB_SANDBOXES = ("docker", "kvm")
NODE_SANDBOXES = ("docker", "kvm", "process")
DEFAULT_SANDBOX = "docker"
# Which node sandboxes run a job's sandbox. A VM is never swapped for a container: a job that asked
# for kvm isolation gets it.
SANDBOX_HOSTS = {"docker": ("docker", "process"), "kvm": ("kvm",)}


def sandbox_hosts(sandbox: str) -> tuple[str, ...]:
    """The node sandboxes that may run a job asking for ``sandbox`` (an unknown one: only itself)."""
    return SANDBOX_HOSTS.get(sandbox, (sandbox,))


# -- environment names -----------------------------------------------------------------------------

# Env names a job may not set, in any letter case. The prefixes steer the GPU stack, the dynamic
# loader (the NVIDIAScape escape used LD_PRELOAD) or are the agent's own; the rendezvous names are
# set by the agent for a gang. The portal refuses them at submit; the agent drops them again so a
# bug there cannot become an escape.
RESERVED_ENV_PREFIXES = ("CUDA_", "NVIDIA_", "LD_", "GPUPORTAL_")
RENDEZVOUS_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")


def is_reserved_env(name: str) -> bool:
    upper = str(name).upper()
    return upper.startswith(RESERVED_ENV_PREFIXES) or upper in RENDEZVOUS_KEYS


# -- job events ------------------------------------------------------------------------------------

# The states an agent reports for an attempt (POST .../events), and the ones that end it. The
# portal's own job states are a superset (queued, assigned, preempted, node_fail are its verdicts).
EVENT_STATES = ("starting", "running", "succeeded", "failed", "timeout", "oom", "cancelled")
TERMINAL_EVENT_STATES = frozenset({"succeeded", "failed", "timeout", "oom", "cancelled"})


# What a launch reports while it prepares (POST .../progress): the job's reason code until it runs.
PROGRESS_STAGES = ("pulling", "staging")  # staging: fetching its datasets into the node's cache
PROGRESS_MESSAGE_MAX = 300  # the job's reason_message


# -- images ----------------------------------------------------------------------------------------

DOCKER_HUB = "docker.io"
# The names Docker Hub goes by in a login (a project stores any of them).
DOCKER_HUB_ALIASES = ("docker.io", "index.docker.io", "registry-1.docker.io")


def image_registry(image: str) -> str:
    """The registry (host[:port]) an image reference pulls from, as Docker reads it: the part before
    the first "/" when it has a "." or a ":" or is "localhost", else Docker Hub."""
    first, sep, _ = str(image).partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return DOCKER_HUB


def image_tag(image: str) -> str:
    """The tag of an image reference ("latest" when it names none); "" for a digest reference."""
    if "@" in image:
        return ""
    last = image.rsplit("/", 1)[-1]
    return last.partition(":")[2] or "latest"


# -- message shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One JSON object the agent sends up, by its keys. ``path``: where it is POSTed under
    /api/agent/v1/ ({job_id} filled in); None for an object nested in another. The portal's
    serializer for it declares exactly these fields, the required ones required (the agent API
    refuses to load otherwise), and the agent's client builds its bodies through ``body``."""

    path: str | None
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return self.required + self.optional

    def body(self, **values) -> dict:
        """The object with these values; ValueError for a key the message lacks or a required one missing."""
        unknown = set(values) - set(self.fields)
        missing = set(self.required) - set(values)
        if unknown or missing:
            raise ValueError(f"{self.path or 'message'}: unknown keys {sorted(unknown)}, missing {sorted(missing)}")
        return values


GPU_INVENTORY = Message(None, ("index", "uuid", "model", "memory_mb"), ("pci_bus_id", "topology"))
REGISTER = Message("register", ("name", "cpus", "memory_mb", "sandbox", "gpus"),
                   ("capabilities", "gpus_unusable", "protocol_version", "cached_datasets"))
PROBE = Message("probe", ("nonce",))
SAMPLE = Message(None, ("gpu_uuid",), ("ts", "utilization", "memory_used_mb", "memory_total_mb", "temperature_c",
                                        "power_w", "power_limit_w", "ecc_errors", "xid_errors", "processes"))
HEARTBEAT_JOB = Message(None, ("job_id", "attempt", "state"))
# cached_datasets: the sha256 digests (64 hex) the node's dataset cache holds (agents/datasets.py); sent at
# registration and whenever they change, absent otherwise (the portal keeps the last list).
HEARTBEAT = Message("heartbeat", (), ("samples", "jobs", "cached_datasets"))
CACHED_DATASETS_MAX = 10000
CONFIRM = Message("jobs/{job_id}/confirm", ("attempt",))
SCRUB_FAILURE = Message(None, ("gpu_index", "message"))
EVENT = Message("jobs/{job_id}/events", ("attempt", "state"),
                ("exit_code", "message", "scrub_failures", "node_problem", "lease_expired", "not_startable"))
# Protocol 1.2: several jobs' events in one request (many jobs ending together), each an EVENT with its
# job_id, applied one by one (each idempotent and fenced by its attempt) in one transaction where the
# portal can. The answer lists each one's result in order: "applied", "duplicate" or "stale" (the 409
# of a single report). A portal before 1.2 answers 404: the agent sends them one by one.
BATCH_EVENT = Message(None, ("job_id",) + EVENT.required, EVENT.optional)
EVENTS = Message("events", ("events",))
EVENTS_MAX = 200  # events in one request; a node with more ending at once sends several
# Protocol 1.7: several launches' confirmations in one request (a node's launches of one pass), each a
# CONFIRM with its job_id, applied in one transaction where the portal can. The answer lists each one's
# result in order: "confirmed" with its launch spec, or "stale" (the 409 of a single confirm: start
# nothing). A portal before 1.7 answers 404: the agent confirms them one by one.
BATCH_CONFIRM = Message(None, ("job_id",) + CONFIRM.required)
CONFIRMS = Message("confirms", ("confirms",))
LOG = Message("jobs/{job_id}/logs", ("attempt", "offset"), ("data", "data_base64"))  # exactly one of the two
MESSAGES = (GPU_INVENTORY, REGISTER, PROBE, SAMPLE, HEARTBEAT_JOB, HEARTBEAT, CONFIRM, SCRUB_FAILURE, EVENT, BATCH_EVENT,
            EVENTS, BATCH_CONFIRM, CONFIRMS, LOG)
# Private images (an agent asks only when it must pull; a portal without them answers 404): the project's
# login to the registry of the attempt's image, and what a launch is doing before it runs (the job's reason).
REGISTRY_AUTH = Message("jobs/{job_id}/registry-auth", ("attempt",))
PROGRESS = Message("jobs/{job_id}/progress", ("attempt", "stage", "message"))
MESSAGES += (REGISTRY_AUTH, PROGRESS)


# Longest texts of a job event: a longer report would be refused, leaving the job running there.
EVENT_MESSAGE_MAX = 2000
NODE_PROBLEM_MAX = 500
