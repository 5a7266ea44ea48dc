"""Sandbox drivers: where a job's process runs, and how it is contained.

Every driver offers the same six calls (``Driver`` below) over a
``SandboxHandle``; the agent never looks inside a handle. Drivers:

- ``docker``: the production default, hardened per docs/design.md section 6 and
  docs/reliability.md 2.3;
- ``process``: a plain subprocess for machines without Docker; it isolates
  nothing and says so at every start;
- ``kvm``: a libvirt VM per job that boots the project's kernel and initramfs
  with the job's image unpacked in it, GPUs passed through by PCI address.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Protocol

from agents.protocol import RENDEZVOUS_KEYS, is_reserved_env

log = logging.getLogger(__name__)

# Sandbox states as ``poll`` reports them. ``oom`` is an exit caused by the
# memory limit; the agent maps ``exited`` to succeeded/failed by exit code. A sandbox whose per-job
# supervisor killed it when the node's lease ran out polls as ``lease_expired`` (agents/supervisor/).
RUNNING = "running"
EXITED = "exited"
OOM = "oom"

# Labels every sandbox carries, so a restarted agent finds its own (reconcile).
LABEL_JOB = "gpuportal.job"
LABEL_ATTEMPT = "gpuportal.attempt"
LABEL_NODE = "gpuportal.node"
LABEL_TIME_LIMIT = "gpuportal.time_limit_s"
LABEL_GPUS = "gpuportal.gpus"  # host GPU indexes, comma-separated
LABEL_INSTALLATION = "gpuportal.installation"  # set where agents of several installations share an engine


class SandboxError(Exception):
    """A sandbox could not be created or driven; the message is for the job's owner."""


@dataclass(kw_only=True)
class LaunchSpec:
    """Everything a driver needs to start one attempt of one job."""

    job_id: str
    attempt: int
    image: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    gpu_indexes: list[int] = field(default_factory=list)
    gpu_uuids: list[str] = field(default_factory=list)
    cpus: float = 1.0
    memory_mb: int = 1024
    pids_limit: int = 512
    time_limit_s: float = 3600.0
    network: bool = False
    array_index: int | None = None
    gpu_fraction: float | None = None
    gpu_memory_mb: int | None = None
    rendezvous: dict | None = None
    # The job's project (portal id): the docker sandbox runs each project's jobs under a uid of its own.
    project_id: int | None = None
    # Project volumes: [{"name", "read_only", "path"}], paths below the node's volumes root
    # (agents/sandbox/volumes.py); and the job's checkpoint folder {"volume", "path"} there.
    volumes: list[dict] = field(default_factory=list)
    checkpoint: dict | None = None
    # Published ports (agents/sessions.py): [{"name", "kind", "port", "secret", "base_url"}].
    sessions: list[dict] = field(default_factory=list)
    # The job checkpoints (its spec's `checkpoint`): the signal it traps and its grace to save. The
    # agent sends it before stopping the job to move it, and grace_s before its time limit.
    checkpoint_signal: str | None = None
    checkpoint_grace_s: float | None = None
    # Its spec's `checkpoint.interval_s`: how often it should save on its own, told to it in
    # GPUPORTAL_CHECKPOINT_INTERVAL_S. None: it saves only when signalled.
    checkpoint_interval_s: int | None = None
    # Outputs (agents/artifacts.py): a writable /outputs whose files the agent uploads to the portal when
    # the attempt ends. False (an older portal's launch): no /outputs.
    outputs: bool = False
    # Datasets (agents/datasets.py): the portal's [{"name", "version", "digest", "size", "archive", "files"}],
    # and, once the agent has them in its cache, {name: host folder}, mounted read-only at /datasets/<name>.
    datasets: list[dict] = field(default_factory=list)
    dataset_paths: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not self.command or not all(isinstance(a, str) for a in self.command):
            raise SandboxError("command: must be a non-empty list of strings")
        if len(self.gpu_indexes) != len(self.gpu_uuids):
            raise SandboxError(
                f"gpus: {len(self.gpu_indexes)} indexes but {len(self.gpu_uuids)} uuids")
        if self.cpus <= 0 or self.memory_mb <= 0 or self.pids_limit <= 0 or self.time_limit_s <= 0:
            raise SandboxError("cpus, memory_mb, pids_limit and time_limit_s must be positive")

    @classmethod
    def from_dict(cls, d: dict, *, job_id: str, attempt: int, inventory=()) -> "LaunchSpec":
        """Build a spec from the portal's JSON (the task argument or confirm's ``spec``).

        Takes the flat field names of this class; also accepts the job-spec
        shape (``resources: {cpus, memory_mb, gpu_memory_mb}``, ``time_limit``)
        and fills ``gpu_uuids`` from ``gpu_indexes`` (or back) with this node's
        ``inventory``. Unknown keys are ignored so the portal can add fields.
        """
        d = dict(d)
        res = d.pop("resources", None) or {}
        for k in ("cpus", "memory_mb", "gpu_memory_mb"):
            if k not in d and k in res:
                d[k] = res[k]
        if "time_limit_s" not in d and "time_limit" in d:
            d["time_limit_s"] = d["time_limit"]
        by_index = {g.index: g.uuid for g in inventory}
        by_uuid = {g.uuid: g.index for g in inventory}
        if d.get("gpu_indexes") and not d.get("gpu_uuids"):
            try:
                d["gpu_uuids"] = [by_index[int(i)] for i in d["gpu_indexes"]]
            except KeyError as exc:
                raise SandboxError(f"gpu_indexes: this node has no GPU {exc.args[0]}") from None
        if d.get("gpu_uuids") and not d.get("gpu_indexes"):
            try:
                d["gpu_indexes"] = [by_uuid[u] for u in d["gpu_uuids"]]
            except KeyError as exc:
                raise SandboxError(f"gpu_uuids: this node has no GPU {exc.args[0]}") from None
        unknown = [u for u in d.get("gpu_uuids") or () if by_uuid and u not in by_uuid]
        if unknown:
            raise SandboxError(f"gpu_uuids: this node has no GPU {unknown[0]}")
        names = {f.name for f in dataclasses.fields(cls)} - {"job_id", "attempt"}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        try:
            return cls(job_id=str(job_id), attempt=int(attempt), **kwargs)
        except TypeError as exc:
            raise SandboxError(f"spec: {exc}") from None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SandboxHandle:
    """A driver's reference to one sandbox. ``ref`` is the driver's own id."""

    driver: str
    ref: str
    job_id: str
    attempt: int
    started_at: float  # wall clock, so a restarted agent can still enforce limits
    time_limit_s: float | None = None
    gpu_indexes: list[int] = field(default_factory=list)


class Driver(Protocol):
    name: str

    def launch(self, spec: LaunchSpec) -> SandboxHandle: ...

    def poll(self, handle: SandboxHandle) -> tuple[str, int | None]: ...

    def read_logs(self, handle: SandboxHandle, offset: int) -> bytes:
        """Raw output from byte ``offset`` on; possibly only its first part (a driver may bound one
        read), and b"" when there is nothing more for now."""

    def stop(self, handle: SandboxHandle, grace_s: float) -> None: ...

    # Optional (process, docker): send a named signal ("SIGUSR1") to the job, for a checkpoint.
    # def signal(self, handle: SandboxHandle, name: str) -> None: ...

    def list_own(self) -> list[tuple[str, int, SandboxHandle]]: ...

    def remove(self, handle: SandboxHandle) -> None: ...


def job_env(spec: LaunchSpec, *, visible_devices: list[str]) -> dict[str, str]:
    """The job's environment: the tenant's variables minus reserved names, plus ours.

    ``visible_devices`` is what CUDA_VISIBLE_DEVICES should say inside this
    sandbox (a container renumbers its GPUs from 0; a bare process does not).
    """
    env = {}
    for k, v in (spec.env or {}).items():
        if is_reserved_env(k):  # the portal refuses these at submit: dropping them again stops a bug there
            log.warning("job %s: dropping reserved env name %s", spec.job_id, k)
            continue
        env[str(k)] = str(v)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
    env["GPUPORTAL_JOB_ID"] = spec.job_id
    env["GPUPORTAL_ATTEMPT"] = str(spec.attempt)
    if spec.array_index is not None:
        env["GPUPORTAL_ARRAY_INDEX"] = str(spec.array_index)
    if spec.checkpoint_signal and spec.checkpoint_interval_s:
        env["GPUPORTAL_CHECKPOINT_INTERVAL_S"] = str(int(spec.checkpoint_interval_s))
    for k in RENDEZVOUS_KEYS:
        if spec.rendezvous and spec.rendezvous.get(k) is not None:
            env[k] = str(spec.rendezvous[k])
    if spec.gpu_fraction is not None:
        # A shared GPU runs under CUDA MPS: cap this client's SMs and memory.
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, int(round(spec.gpu_fraction * 100))))
        if spec.gpu_memory_mb:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
                f"{i}={spec.gpu_memory_mb}M" for i in range(len(visible_devices)))
    return env


def sandbox_name(job_id: str, attempt: int, rank: int | None = None, *, scope: str | None = None) -> str:
    """A name the engine keeps unique, so one attempt can never run twice.

    ``scope`` (the node, and the installation when several share a host)
    keeps agents that share one engine or libvirtd apart. A multi-node gang's
    parts add their rank: two nodes may share one engine.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:100]
    prefix = "gpuportal-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", scope)[:60] + "-" if scope else "")
    return f"{prefix}{safe}-{attempt}" + (f"-rank{rank}" if rank is not None else "")


def uid_range(raw: str, setting: str) -> tuple[int, int]:
    """``FIRST-LAST`` (a setting of uids the agent hands out) as two ints; SandboxError naming ``setting``."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", raw)
    if not m or not 1000 <= int(m.group(1)) <= int(m.group(2)) < 2**31:
        raise SandboxError(f"{setting}: expected FIRST-LAST (uids of 1000 and up), got {raw!r}")
    return int(m.group(1)), int(m.group(2))


def node_rank(spec: LaunchSpec) -> int | None:
    """This part's rank in a gang spread over several nodes, else None."""
    if not spec.rendezvous or spec.rendezvous.get("NODE_RANK") is None:
        return None
    return int(spec.rendezvous["NODE_RANK"])


def make_driver(name: str, *, node: str, **kwargs) -> Driver:
    if name == "docker":
        from agents.sandbox.docker_driver import DockerDriver

        return DockerDriver(node=node, **kwargs)
    if name == "process":
        from agents.sandbox.process_driver import ProcessDriver

        return ProcessDriver(node=node, **kwargs)
    if name == "kvm":
        from agents.sandbox.kvm_driver import KvmDriver

        return KvmDriver(node=node, **kwargs)
    raise ValueError(f"--sandbox: expected docker, kvm or process, got {name!r}")
