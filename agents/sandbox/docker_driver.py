"""Docker sandbox: the production driver.

Hardening follows docs/reliability.md 2.3 and docs/design.md section 6: no network unless
the job asked and the project allowed it, every capability dropped,
no-new-privileges, read-only root with tmpfs /work and /tmp, a non-root user,
memory (no swap), pids and CPU limits, and only the allocated GPUs by UUID.
``docker inspect`` of a job container shows all of it (tests/agents assert it).

A gang spread over several nodes whose project allows network gets a
job-private network instead of the engine's default bridge: one per (job,
attempt), named ``gpuportal-job-<id>-<attempt>`` and labelled like the
containers. Each part joins it under the alias ``rank<NODE_RANK>`` and
``MASTER_ADDR`` says ``rank0``, so torchrun and NCCL find rank 0 through the
engine's DNS whichever node it landed on. On one engine a ``bridge`` network is
enough; across hosts the engines must share a Docker swarm, and the network is
an attachable ``overlay`` (``--gang-network-driver auto``, the default, picks
overlay when the engine is in a swarm). The last part to leave removes it;
empty ones left by a crash are pruned when the next gang makes its network.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import docker
import docker.errors
import docker.types
import requests
from docker.models.containers import _create_container_args  # the SDK's own translation of create's options

from agents import supervisor
from agents.datasets import MOUNT_ROOT as DATASETS_MOUNT
from agents.sandbox import (
    EXITED, LABEL_ATTEMPT, LABEL_GPUS, LABEL_INSTALLATION, LABEL_JOB, LABEL_NODE, LABEL_TIME_LIMIT, OOM, RUNNING,
    LaunchSpec, SandboxError, SandboxHandle, job_env, node_rank, sandbox_name, uid_range,
)
from agents.sandbox.docker_logs import ContainerLog
from agents.sandbox.egress import EgressError, Firewall, parse_allow
from agents.sandbox.images import ImageCache
from agents.sandbox.kvm_domain import driver_dir, private_dir
from agents.sandbox.volumes import VolumePathError, plan_mounts
from agents.supervisor.lease import FENCED, forget_fenced, was_fenced

log = logging.getLogger(__name__)

LABEL_NETWORK = "gpuportal.network"  # on the job networks this driver makes
OUTPUTS_MOUNT = "/outputs"  # the job's outputs, uploaded as artifacts when it ends (agents/artifacts.py)
# The job's session folder (docs/sessions.md): JupyterLab's settings and the unix sockets its apps listen
# on, which the agent's session gateway connects to from the host. The container keeps network none.
SESSIONS_MOUNT = "/run/gpuportal"
# The network of jobs with network (a gang spread over nodes gets its own). Its bridge, and a gang's, are
# named gpj<hash>: the egress policy matches traffic coming in from them by that prefix.
JOB_NETWORK = "gpuportal-jobs"
# A container that died by SIGKILL without the engine's OOMKilled flag: how far back its event log
# is read for an "oom" event, and how long a late one is waited for (_oom_killed).
OOM_EVENT_LOOKBACK_S = 24 * 3600
OOM_EVENT_GRACE_S = 1.0
BRIDGE_PREFIX = "gpj"
EGRESS_CHAIN = "GPUPORTAL-DOCKER"
LABEL_SIMULATED = "gpuportal.simulated_gpus"  # "1" on a GPU job run on simulated GPUs

# The /etc/hosts of a job without network (the engine writes none for it): what it writes for "none".
JOB_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
# nobody:nogroup, for a launch that names no project (an older portal); owns nothing on the host.
JOB_USER = "65534:65534"
# Each project's jobs run as uid = gid = first + project id: two tenants' jobs on one node never share a
# uid (signals, /proc, files on a shared mount). Owns nothing on the host either.
JOB_UIDS = "2000000-2999999"
NO_GPU_MESSAGE = (
    "this node's Docker engine has no NVIDIA GPU support (no 'nvidia' runtime and no "
    "NVIDIA Container Toolkit hook); GPU jobs cannot run on this node, CPU jobs can"
)
# What the agent registers as the reason its (real) GPUs cannot serve docker jobs.
NO_RUNTIME_REASON = "Docker engine has no NVIDIA runtime"
# The first line of a GPU job's log on simulated GPUs: the job must not think it computed on a GPU.
SIMULATED_NOTICE = (b"[gpuportal] simulated GPUs: no NVIDIA runtime, the job sees the GPU environment only "
                    b"(CUDA_VISIBLE_DEVICES and the rest), no GPU device\n")


class SandboxExists(SandboxError):
    """The engine already has a sandbox for this (job, attempt): never start it twice."""


class DockerDriver:
    name = "docker"

    def __init__(self, *, node: str, client=None, job_network: str = JOB_NETWORK,
                 nofile: int | None = 4096, gang_network_driver: str = "auto",
                 gang_network_internal: bool = False, simulated_gpus: bool = False,
                 egress_allow: str | list[str] | None = None, log_max_size: str = "10m", log_max_files: int = 3,
                 installation: str | None = None, job_uids: str | None = None, volumes_root: str | None = None,
                 state_dir: str | None = None, supervise: bool = False, image_cache_gb: float | None = None):
        self.node = node
        # supervise (the agent sets it): the node's containers have one supervisor process that outlives
        # the agent and kills them when the node's lease file, in the agent's state folder, runs out
        # (agents/supervisor/__main__.py, docker-node); lease_s and fence_grace_s (set by the agent from
        # its registration) stand in until the file exists.
        self.lease_path = driver_dir("docker", node, state_dir) / "lease" if supervise else None
        self.state_dir = state_dir  # the agent's; each job's outputs folder is made in our folder there
        self.lease_s, self.fence_grace_s = 60.0, 3.0
        self.node_supervisor: subprocess.Popen | None = None  # the one this driver started last
        self._supervisor_lock = threading.Lock()
        # The operator's tree of project volumes, at the same path as on the portal (docs/storage.md).
        self.volumes_root = volumes_root if volumes_root is not None else os.environ.get("GPUPORTAL_VOLUMES_ROOT", "")
        # Several installations may share one engine: names and adoption go by installation and node.
        self.installation = installation if installation is not None else os.environ.get("GPUPORTAL_INSTALLATION", "")
        self.job_uids = uid_range(job_uids or os.environ.get("GPUPORTAL_JOB_UIDS") or JOB_UIDS, "GPUPORTAL_JOB_UIDS")
        # The engine's json-file log of each job is rotated at this size and count: what the agent
        # has not read when it rotates is lost, so it must hold several passes of a chatty job.
        self.log_config = docker.types.LogConfig(type="json-file", config={
            "max-size": log_max_size, "max-file": str(log_max_files)})
        self._logs: dict[str, ContainerLog] = {}  # container id -> what was read of its log
        # The container each poll inspected last, for the log reads that follow it in the agent's pass (they
        # need only its id and labels): one inspect a running job a pass, however much of its log is read.
        self._polled: dict = {}
        # Containers whose exit the engine flagged no OOM kill for, checked against its event log
        # (_oom_killed): container id -> whether an "oom" event was found. Forgotten on remove.
        self._oom_checked: dict[str, bool] = {}
        # Simulated GPUs (a laptop, CI, the demo): a GPU job runs without the NVIDIA runtime, with the
        # same environment, limits and isolation as on real GPUs, and its log says so first.
        self.simulated_gpus = simulated_gpus
        if job_network in ("bridge", "host", "none"):  # docker's own: no policy of ours would hold there
            raise SandboxError(f"job network {job_network!r}: name a network for the agent to make")
        self.job_network = job_network  # used only for jobs with network allowed; made on first use
        # Egress of jobs with network (agents/sandbox/egress.py): public internet only, unless allowed.
        try:
            allow = parse_allow(egress_allow if egress_allow is not None
                                else os.environ.get("GPUPORTAL_EGRESS_ALLOW", ""))
        except EgressError as exc:
            raise SandboxError(str(exc)) from None
        self.firewall = Firewall(chain=EGRESS_CHAIN, allow=allow, hooks=[
            ("INPUT", ["-i", BRIDGE_PREFIX + "+"]), ("DOCKER-USER|FORWARD", ["-i", BRIDGE_PREFIX + "+"])])
        self._egress_installed = False
        # A multi-node gang's private network: "bridge" (one engine) or "overlay"
        # (a swarm); internal means the ranks reach each other and nothing else.
        self.gang_network_driver = gang_network_driver
        self.gang_network_internal = gang_network_internal
        # Open-file cap per job (a DoS limit). Must not exceed dockerd's own hard
        # limit, or runc refuses to start the container; None keeps the engine's.
        self.nofile = nofile
        try:
            self.client = client or docker.from_env()  # version=None: negotiates the engine's API
            self.client.ping()
        except (docker.errors.DockerException, requests.RequestException) as exc:
            raise SandboxError(f"the Docker engine is not answering: {exc}") from exc
        self._gpu_support: bool | None = None
        # Job images this node pulled (agents/sandbox/images.py): the pull policy, the logins, the size limit.
        if image_cache_gb is None:
            image_cache_gb = float(os.environ.get("GPUPORTAL_IMAGE_CACHE_GB") or 0)
        self.images = ImageCache(self.client, node=node,
                                 state_path=lambda: driver_dir("docker", node, state_dir) / "images.json",
                                 limit_bytes=int(image_cache_gb * 1e9) if image_cache_gb else None)
        if simulated_gpus:
            log.info("docker sandbox: simulated GPUs: GPU jobs run without the NVIDIA runtime and see "
                     "the GPU environment only")
        if gang_network_driver == "auto":
            # A swarm spans hosts, so an overlay network reaches a gang's parts wherever they run; a lone
            # engine's bridge reaches only the parts on this host.
            swarm = (self.client.info().get("Swarm") or {}).get("LocalNodeState") == "active"
            self.gang_network_driver = "overlay" if swarm else "bridge"
            if not swarm:
                log.info("docker sandbox: this engine is in no swarm: a multi-node gang's network reaches only "
                         "its parts on this host (put the nodes' engines in one swarm for gangs across hosts)")

    # -- capability ---------------------------------------------------------

    def gpu_support(self) -> bool:
        """Whether the engine can hand GPUs to containers.

        Either an ``nvidia`` runtime is configured, or the NVIDIA Container
        Toolkit's prestart hook is installed (Docker's ``--gpus`` path uses it).
        Checked once: installing the toolkit needs a dockerd restart anyway.
        """
        if self._gpu_support is None:
            runtimes = (self.client.info().get("Runtimes") or {})
            self._gpu_support = "nvidia" in runtimes or bool(shutil.which("nvidia-container-runtime-hook"))
        return self._gpu_support

    def gpu_problem(self) -> str | None:
        """Why this node's GPUs cannot serve docker jobs, or None. The agent registers it, and the
        portal keeps GPU jobs off those GPUs instead of sending launches that would fail."""
        if self.simulated_gpus or self.gpu_support():
            return None
        return NO_RUNTIME_REASON

    # -- Driver interface -----------------------------------------------------

    def prepare_image(self, spec: LaunchSpec, *, credentials, progress=None, stopped=None) -> str:
        """Make the job's image present before its launch, pulling it with the project's login when
        the pull policy says so (agents/sandbox/images.py). -> "present" or "pulled"; SandboxError
        with the job's reason when it cannot be had."""
        return self.images.ensure(spec.image, project_id=spec.project_id, credentials=credentials,
                                  progress=progress, stopped=stopped)

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        try:
            return self._launch(spec)
        except SandboxExists:
            raise  # the attempt's sandbox is there: so are its outputs
        except SandboxError:
            if spec.outputs:  # nothing started: its outputs folder must not linger
                shutil.rmtree(self._outputs_path(spec.job_id, spec.attempt, node_rank(spec)), ignore_errors=True)
            raise
        finally:
            self.images.unpin(spec.image)  # its container holds it now (or it never will)

    def _launch(self, spec: LaunchSpec) -> SandboxHandle:
        if spec.gpu_uuids and not self.simulated_gpus and not self.gpu_support():
            raise SandboxError(NO_GPU_MESSAGE)
        if spec.network:
            self._prepare_egress(gang=gang_rank(spec) is not None)
        self.ensure_supervisor()  # before the container exists: no moment without a fence
        kwargs = self._create_kwargs(spec)
        sessions_dir = kwargs.pop("_sessions_dir", None)
        try:
            return self._create_and_start(spec, kwargs, sessions_dir)
        except BaseException:
            if sessions_dir:  # nothing started (or a duplicate, whose sandbox has its own): not kept
                shutil.rmtree(os.path.dirname(sessions_dir), ignore_errors=True)
            raise

    def _create_and_start(self, spec: LaunchSpec, kwargs: dict, sessions_dir: str | None) -> SandboxHandle:
        try:
            if gang_rank(spec) is not None:
                cid = self._create_in_gang_network(spec, kwargs).id
            else:
                cid = self._create(kwargs)
        except docker.errors.ImageNotFound:
            raise SandboxError(f"image {spec.image!r} is not present on node {self.node}") from None
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                raise SandboxExists(f"sandbox {kwargs['name']} already exists") from None
            raise SandboxError(f"could not create the sandbox: {exc.explanation or exc}") from None
        try:
            if sessions_dir:
                self._write_session_record(cid, spec, sessions_dir)
            self.client.api.start(cid)
        except (docker.errors.APIError, OSError, SandboxError) as exc:
            # A failed start leaves a "Created" container behind; it must go, or
            # the next attempt of this job would find its name taken.
            self._force_remove(cid)
            self._forget_session_record(cid)
            if not isinstance(exc, docker.errors.APIError):
                raise SandboxError(f"could not record the job's sessions: {exc}") from None
            msg = exc.explanation or str(exc)
            if "could not select device driver" in msg:
                raise SandboxError(f"{NO_GPU_MESSAGE} (engine said: {msg})") from None
            raise SandboxError(f"could not start the sandbox: {msg}") from None
        log.info("job %s attempt %s: container %s started", spec.job_id, spec.attempt, cid[:12])
        return SandboxHandle(driver=self.name, ref=cid, job_id=spec.job_id, attempt=spec.attempt,
                             started_at=time.time(), time_limit_s=spec.time_limit_s,
                             gpu_indexes=list(spec.gpu_indexes))

    def _create(self, kwargs: dict) -> str:
        """The container's id: one engine call, where the docker SDK's ``containers.create`` adds an
        inspect to build its object (a launch needs only the id)."""
        args = _create_container_args({**kwargs, "version": self.client.api._version})
        return self.client.api.create_container(**args)["Id"]

    def job_uid(self, spec: LaunchSpec) -> int:
        """The uid (and gid) the job runs as: its project's own, or nobody when the launch names none."""
        if spec.project_id is None:
            return int(JOB_USER.split(":")[0])
        first, last = self.job_uids
        if not 0 <= spec.project_id <= last - first:
            raise SandboxError(f"project {spec.project_id} has no uid in node {self.node}'s range {first}-{last} "
                               f"(GPUPORTAL_JOB_UIDS)")
        return first + spec.project_id

    def _create_kwargs(self, spec: LaunchSpec) -> dict:
        n = len(spec.gpu_uuids)
        env = job_env(spec, visible_devices=[str(i) for i in range(n)])
        # Never let the image's NVIDIA_VISIBLE_DEVICES pick GPUs: on an engine with
        # the nvidia runtime as default, "all" in an image would expose every GPU.
        # Simulated UUIDs name no device: "void" keeps such a runtime from failing the start.
        real = n and not self.simulated_gpus
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids) if real else "void"
        env.setdefault("HOME", "/work")
        mem = f"{spec.memory_mb}m"
        uid = self.job_uid(spec)
        user = f"{uid}:{uid}"
        try:
            binds, checkpoint_dir, _ = plan_mounts(self.volumes_root, spec.volumes, spec.checkpoint,
                                                   owner=uid if spec.project_id is not None else None)
        except (VolumePathError, OSError) as exc:
            raise SandboxError(f"volumes: {exc}") from None
        if checkpoint_dir:
            env["GPUPORTAL_CHECKPOINT_DIR"] = checkpoint_dir
        # Datasets from the node's cache (agents/datasets.py), read-only: shared by every job that names them.
        binds.extend((host, f"{DATASETS_MOUNT}/{name}", True) for name, host in sorted(spec.dataset_paths.items()))
        if spec.outputs:
            binds.append((self._make_outputs_dir(spec, uid), OUTPUTS_MOUNT, False))
            env["GPUPORTAL_OUTPUTS_DIR"] = OUTPUTS_MOUNT
        sessions_dir = self._make_sessions_dir(spec, uid, env) if spec.sessions else None
        if sessions_dir:  # removed again by _launch if the container is not made
            binds.append((sessions_dir, SESSIONS_MOUNT, False))
        if not spec.network:  # no network at all (network_disabled below): the engine writes no hosts file
            binds.append((self._hosts_file(), "/etc/hosts", True))
        kwargs = dict(
            image=spec.image,
            command=list(spec.command),
            name=sandbox_name(spec.job_id, spec.attempt, node_rank(spec),
                              scope="-".join(filter(None, (self.installation, self.node)))),
            detach=True,
            environment=env,
            labels={
                LABEL_JOB: spec.job_id,
                LABEL_ATTEMPT: str(spec.attempt),
                LABEL_NODE: self.node,
                LABEL_TIME_LIMIT: str(spec.time_limit_s),
                **({LABEL_INSTALLATION: self.installation} if self.installation else {}),
                LABEL_GPUS: ",".join(str(i) for i in spec.gpu_indexes),
            },
            user=user,
            working_dir="/work",
            read_only=True,
            # tmpfs counts against the memory limit, so their size cannot add to it.
            # uid/gid, not mode: Docker 20.10 ignores mode on the working dir (moby#39466).
            tmpfs={
                "/work": f"rw,exec,nosuid,nodev,size={mem},uid={uid},gid={uid},mode=0700",
                "/tmp": f"rw,noexec,nosuid,nodev,size={mem},mode=1777",
            },
            network_mode=self.job_network if spec.network else "none",
            # A job without network gets a namespace of its own with only loopback (runc's), not the engine's
            # "none" network: for that one Docker 28 adds a prestart hook that runs the dockerd binary again
            # at every start, about half the engine's start time (bench/engine_start.py).
            network_disabled=not spec.network,
            cgroupns="private",  # the job sees its own cgroup as /, not the host's hierarchy
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            privileged=False,
            mem_limit=mem,
            memswap_limit=mem,  # equal to mem_limit: no swap
            pids_limit=spec.pids_limit,
            nano_cpus=int(spec.cpus * 1e9),
            ulimits=[docker.types.Ulimit(name="nofile", soft=self.nofile, hard=self.nofile)]
            if self.nofile else None,
            # docker-init as PID 1 forwards SIGTERM to the job; a bare PID 1
            # ignores it and every stop would wait out the whole grace period.
            init=True,
            stop_signal="SIGTERM",
            log_config=self.log_config,
            mounts=[docker.types.Mount(target=c, source=h, type="bind", read_only=ro) for h, c, ro in binds],
        )
        rank = gang_rank(spec)
        if rank is not None:
            # The network itself is found or made at launch (_create_in_gang_network).
            del kwargs["network_mode"]
            kwargs["hostname"] = f"rank{rank}"
            env["MASTER_ADDR"] = "rank0"
        if n and self.simulated_gpus:
            kwargs["labels"][LABEL_SIMULATED] = "1"  # read_logs puts the notice first, also after a restart
        if real:
            kwargs["device_requests"] = [
                docker.types.DeviceRequest(driver="nvidia", device_ids=list(spec.gpu_uuids),
                                           capabilities=[["gpu"]])
            ]
        if sessions_dir:
            kwargs["_sessions_dir"] = sessions_dir
        return kwargs

    def _hosts_file(self) -> str:
        """The /etc/hosts of jobs without network, as the engine writes it for its "none" network
        (localhost only), in this driver's folder; mounted read-only."""
        path = driver_dir("docker", self.node, self.state_dir) / "hosts"
        if not path.exists() or path.read_text() != JOB_HOSTS:
            tmp = path.with_name(f"hosts.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(JOB_HOSTS)
            tmp.chmod(0o644)
            tmp.replace(path)
        return str(path)

    def _outputs_path(self, job_id: str, attempt: int, rank: int | None) -> Path:
        scope = "-".join(filter(None, (self.installation, self.node)))
        return driver_dir("docker", self.node, self.state_dir) / "outputs" / sandbox_name(job_id, attempt, rank,
                                                                                         scope=scope)

    def _make_outputs_dir(self, spec: LaunchSpec, uid: int) -> str:
        """The job's /outputs on the host: a folder of the job's uid in this driver's private folder
        (0700 on the way: no other host user reads it). The folder of this attempt's existing sandbox (a
        duplicate launch, which the engine then refuses) is kept as it is."""
        folder = self._outputs_path(spec.job_id, spec.attempt, node_rank(spec))
        try:
            private_dir(folder.parent, 0o700)
            folder.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                try:
                    os.fchown(fd, uid, uid)
                except PermissionError:  # an agent not run as root: the folder must let the job's uid in
                    os.fchmod(fd, 0o777)  # (its parent stays 0700: still no other host user gets in)
            finally:
                os.close(fd)
        except OSError as exc:
            raise SandboxError(f"could not make the job's outputs folder: {exc}") from None
        return str(folder)

    def outputs_dir(self, handle: SandboxHandle) -> str | None:
        """The host folder of the job's /outputs (agents/artifacts.py), None when it has none."""
        base = self._outputs_path(handle.job_id, handle.attempt, None)
        # A gang's part is named by its rank: one part of a gang per node, so at most one matches.
        for folder in [base, *sorted(base.parent.glob(glob.escape(base.name) + "-rank*"))]:
            if folder.is_dir():
                return str(folder)
        return None

    # -- interactive sessions (agents/sessions.py) ----------------------------------

    def _make_sessions_dir(self, spec: LaunchSpec, uid: int, env: dict) -> str:
        """The job's session folder on the host, mounted at /run/gpuportal: a folder of the job's uid in a
        0700 folder of the agent's (no other host user reaches the sockets), in the temporary folder so a
        socket's path stays under the 108 bytes AF_UNIX allows. JupyterLab's settings go in it, and the
        session variables in ``env``."""
        import tempfile

        from agents.sessions import jupyter_config, session_env

        outer = tempfile.mkdtemp(prefix=f"gpd-{spec.job_id}-")  # 0700, the agent's
        inner = os.path.join(outer, "s")
        sockets = {s["name"]: f"{SESSIONS_MOUNT}/{s['name']}.sock" for s in spec.sessions if s["kind"] == "jupyter"}
        try:
            os.mkdir(inner, 0o700)
            owned = _give(inner, uid, 0o700)
            for s in spec.sessions:
                if s["kind"] == "jupyter":
                    os.makedirs(os.path.join(inner, "jupyter"), mode=0o700, exist_ok=True)
                    _give(os.path.join(inner, "jupyter"), uid, 0o700)
                    config = jupyter_config(s, sockets[s["name"]])
                    # The gateway connects as the agent: as root it passes 0600; otherwise the job's folder
                    # (in the agent's 0700 one) is the fence.
                    config["ServerApp"]["sock_mode"] = "0600" if owned else "0666"
                    path = os.path.join(inner, "jupyter", "jupyter_server_config.json")
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                    with os.fdopen(fd, "w") as f:
                        json.dump(config, f)
                    _give(path, uid, 0o600)
                    env["JUPYTER_CONFIG_PATH"] = f"{SESSIONS_MOUNT}/jupyter"
        except OSError as exc:
            shutil.rmtree(outer, ignore_errors=True)
            raise SandboxError(f"could not make the job's session folder: {exc}") from None
        env.update(session_env(spec.sessions, sockets))
        return inner

    def _sessions_records(self) -> Path:
        return private_dir(driver_dir("docker", self.node, self.state_dir) / "sessions", 0o700)

    def _write_session_record(self, container_id: str, spec: LaunchSpec, sessions_dir: str) -> None:
        """What a restarted agent needs to serve the container's sessions again (agents/sessions.py
        SessionDriver.list_own): kept in the agent's folder, out of the job's reach."""
        path = self._sessions_records() / f"{container_id}.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"dir": os.path.dirname(sessions_dir), "sessions": spec.sessions}, f)
        os.replace(tmp, path)

    def _forget_session_record(self, container_id: str) -> None:
        try:
            (self._sessions_records() / f"{container_id}.json").unlink(missing_ok=True)
        except (OSError, SandboxError):
            pass

    def _session_record(self, container_id: str) -> dict | None:
        try:
            return json.loads((self._sessions_records() / f"{container_id}.json").read_text())
        except (OSError, ValueError, SandboxError):
            return None

    def session_specs(self, handle: SandboxHandle) -> list[dict]:
        return (self._session_record(handle.ref) or {}).get("sessions") or []

    def session_targets(self, handle: SandboxHandle, sessions: list[dict]) -> dict[str, tuple]:
        """JupyterLab on its unix socket in the job's session folder, which the gateway reaches from the
        host side of the mount; an HTTP app on its port on the container's own loopback, which the
        gateway reaches by entering the container's network namespace (agents/sessions.py NetnsRelay), or,
        for an agent not run as root, through ``docker exec`` of a forwarder (docker_sessions.ExecRelay):
        the container itself keeps network none."""
        rec = self._session_record(handle.ref) or {}
        out: dict[str, tuple] = {s["name"]: ("unix", os.path.join(rec["dir"], "s", s["name"] + ".sock"))
                                 for s in sessions if s["kind"] == "jupyter" and rec.get("dir")}
        if os.geteuid() != 0:  # no entering namespaces: the engine carries it (docker_sessions.ExecRelay)
            from agents.sandbox.docker_sessions import ExecRelay

            out.update({s["name"]: ("relay", ExecRelay(self.client, handle.ref, int(s["port"])))
                        for s in sessions if s["kind"] == "http"})
        elif any(s["kind"] == "http" for s in sessions):
            try:
                pid = (self.client.api.inspect_container(handle.ref).get("State") or {}).get("Pid") or 0
            except (docker.errors.APIError, requests.RequestException):
                pid = 0
            if pid:  # else gone already: nothing to reach
                out.update({s["name"]: ("netns", f"/proc/{pid}/ns/net", int(s["port"]))
                            for s in sessions if s["kind"] == "http"})
        return out

    def session_shell(self, handle: SandboxHandle) -> "DockerShell":
        """A shell in the container, as ``docker exec -it`` starts one: the job's user, environment and
        working folder, on a pseudo-terminal the engine makes inside the container."""
        return DockerShell(self.client, handle.ref)

    def _create_in_gang_network(self, spec: LaunchSpec, kwargs: dict):
        """Create the container on the gang's network, making the network if no rank has yet.

        Another rank's last exit may remove the network between our lookup and
        the create; the engine then says 404 and one more round makes it again.
        """
        for round_ in range(3):
            net = self._gang_network(spec)
            endpoint = self.client.api.create_endpoint_config(aliases=[kwargs["hostname"]])
            try:
                return self.client.containers.create(**kwargs, network=net.id,
                                                     networking_config={net.id: endpoint})
            except docker.errors.NotFound as exc:
                if "network" not in str(exc).lower() or round_ == 2:
                    raise
        raise AssertionError("unreachable")

    def _gang_network(self, spec: LaunchSpec):
        name = gang_network_name(spec.job_id, spec.attempt)
        found = self._networks_named(name)
        if not found:
            # Only gangs make these networks, so only a gang's launch sweeps up a crash's empty ones.
            self._prune_gang_networks()
            try:
                self.client.networks.create(
                    name, driver=self.gang_network_driver, internal=self.gang_network_internal,
                    attachable=self.gang_network_driver == "overlay", check_duplicate=True,
                    labels={LABEL_JOB: spec.job_id, LABEL_ATTEMPT: str(spec.attempt), LABEL_NETWORK: "gang"},
                    options={"com.docker.network.bridge.name": bridge_name(name)}
                    if self.gang_network_driver == "bridge" else None)
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: another rank made it first
                    raise SandboxError(f"could not create the job network {name}: "
                                       f"{exc.explanation or exc}") from None
            found = self._networks_named(name)
        if not found:
            raise SandboxError(f"the job network {name} vanished while it was being made")
        # Engines before API 1.44 may let two racing creates both succeed: every
        # rank settles on the lowest id, and the spare is removed while still empty.
        found.sort(key=lambda n: n.id)
        for spare in found[1:]:
            self._remove_network(spare)
        return found[0]

    def _prepare_egress(self, *, gang: bool) -> None:
        """The job network exists (unless a gang makes its own) and the egress policy is in force, or
        SandboxError: a job with network never starts unfiltered."""
        if not gang and not self._networks_named(self.job_network):
            try:
                # No traffic between jobs on it (icc off, enforced by the engine where it runs iptables).
                self.client.networks.create(
                    self.job_network, driver="bridge", check_duplicate=True, labels={LABEL_NETWORK: "jobs"},
                    options={"com.docker.network.bridge.name": bridge_name(self.job_network),
                             "com.docker.network.bridge.enable_icc": "false"})
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: another launch made it first
                    raise SandboxError(f"could not create the job network {self.job_network}: "
                                       f"{exc.explanation or exc}") from None
        try:
            # Checked at every such launch: an operator's firewall reload may have flushed it.
            if not self.firewall.installed():
                if self._egress_installed:
                    log.warning("docker sandbox: the egress policy %s was removed from the node's firewall; "
                                "installing it again", EGRESS_CHAIN)
                self.firewall.install()
                self._egress_installed = True
        except EgressError as exc:
            log.error("docker sandbox: egress policy not installed, jobs with network are refused: %s", exc)
            raise SandboxError(f"jobs with network cannot run on node {self.node}: its egress policy cannot "
                               f"be enforced ({exc})") from None

    def _networks_named(self, name: str) -> list:
        # The engine's name filter matches substrings; keep exact names only.
        return [n for n in self.client.networks.list(names=[name]) if n.name == name]

    def _prune_gang_networks(self, keep_younger_than_s: float = 60.0) -> None:
        """Remove gang networks no container uses any more.

        A network younger than a minute may be one a rank has just made and not
        joined yet; the part that leaves last, or a later prune, removes it.
        """
        try:
            nets = self.client.networks.list(filters={"label": [f"{LABEL_NETWORK}=gang"]})
        except (docker.errors.APIError, requests.RequestException) as exc:
            log.warning("could not list job networks: %s", exc)
            return
        now = time.time()
        for net in nets:
            try:
                net.reload()
            except docker.errors.NotFound:
                continue
            created = _parse_ts(net.attrs.get("Created")) or now
            if not net.attrs.get("Containers") and now - created >= keep_younger_than_s:
                self._remove_network(net)

    def _remove_network(self, net) -> None:
        try:
            net.remove()
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:  # 403/409: a rank joined meanwhile
            log.debug("job network %s kept: %s", net.name, exc.explanation or exc)

    def watch_exits(self, ended) -> None:
        """Call ``ended(container id)`` as soon as one of this node's containers dies: the engine's
        event stream, read by one thread. After the stream broke (the engine restarted) it calls
        ``ended(None)``, since deaths may have gone unseen meanwhile, and reads it again."""
        import threading

        def run():
            delay = 1.0
            while True:
                try:
                    for event in self.client.api.events(decode=True, filters={
                            "type": "container", "event": ["die"], "label": [f"{LABEL_NODE}={self.node}"]}):
                        delay = 1.0
                        ended(event.get("id") or (event.get("Actor") or {}).get("ID"))
                except Exception as exc:  # the agent's ticks still notice every exit
                    log.warning("docker events stream broke (%s); reading it again in %.0fs", exc, delay)
                ended(None)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

        threading.Thread(target=run, name="docker-exits", daemon=True).start()

    def poll(self, handle: SandboxHandle) -> tuple[str, int | None]:
        c = self._get(handle)
        if c is None:
            return EXITED, None  # removed behind our back: no exit code to report
        self._polled[c.id] = c
        st = c.attrs["State"]
        if st["Status"] in ("created", "running", "paused", "restarting"):
            return RUNNING, None
        if was_fenced(self.lease_path, c.id):  # its supervisor stopped it when the node's lease ran out
            return FENCED, st.get("ExitCode")
        # OOMKilled is set when the kernel killed any process in the container for
        # memory, even if the job's main process then exited 0: report it, the
        # job's output is likely incomplete.
        code = st.get("ExitCode")
        return (OOM if st.get("OOMKilled") or self._oom_killed(c.id, code, st.get("FinishedAt")) else EXITED), code

    def _oom_killed(self, container_id: str, code, finished_at: str | None) -> bool:
        """Whether the engine logged an "oom" event for a container that died by SIGKILL (137).

        The engine sets OOMKilled only if containerd's OOM event reached it before the exit event;
        they race, and under load the exit can win (the flag stays false, though the event comes
        a few milliseconds later). The event log has it either way: read it once per container,
        waiting for a late one until ``OOM_EVENT_GRACE_S`` after the container's end (not at all
        when polled later than that, so a burst of killed jobs costs one wait). Only 137: the
        kernel's OOM killer sends SIGKILL, and a job whose parent process reports a child's kill
        otherwise is reported as the exit it chose."""
        if code != 137:
            return False
        seen = self._oom_checked.get(container_id)
        if seen is None:
            seen = self._oom_checked[container_id] = self._oom_event_logged(container_id, _parse_ts(finished_at))
        return seen

    def _oom_event_logged(self, container_id: str, finished: float | None) -> bool:
        now = time.time()
        until = max(now, finished + OOM_EVENT_GRACE_S) if finished else now
        try:
            stream = self.client.api.events(
                since=now - OOM_EVENT_LOOKBACK_S, until=until, decode=True,
                filters={"type": "container", "event": ["oom"], "container": [container_id]})
        except docker.errors.APIError:
            return False
        try:
            for _event in stream:
                return True  # the first one is enough: stop reading before the grace is up
            return False
        finally:
            stream.close()

    def read_logs(self, handle: SandboxHandle, offset: int) -> bytes:
        """Read incrementally: each call asks the engine only for what is new (docker_logs.py)."""
        c = self._polled.get(handle.ref) or self._get(handle)
        if c is None:
            return b""
        cursor = self._logs.get(c.id)
        if cursor is None:
            notice = SIMULATED_NOTICE if c.labels.get(LABEL_SIMULATED) == "1" else b""
            cursor = self._logs.setdefault(c.id, ContainerLog(notice))
        try:
            return cursor.read(c, offset)
        except docker.errors.NotFound:
            return b""  # removed behind our back since its poll, as when _get finds none

    def stop(self, handle: SandboxHandle, grace_s: float) -> None:
        """SIGTERM, wait up to ``grace_s`` for the job to exit, then SIGKILL."""
        c = self._get(handle)
        if c is None or c.status not in ("running", "paused", "restarting"):
            return
        try:
            c.kill(signal="SIGTERM")
        except docker.errors.APIError:
            return  # exited between our look and the signal
        deadline = time.monotonic() + max(0.0, grace_s)
        while True:
            try:
                c.reload()
            except docker.errors.NotFound:
                return
            if c.status != "running":
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        log.info("job %s attempt %s: still running %.1fs after SIGTERM, killing",
                 handle.job_id, handle.attempt, grace_s)
        try:
            c.kill(signal="SIGKILL")
            c.wait(timeout=30)
        except docker.errors.APIError as exc:
            if exc.status_code not in (404, 409):  # 409/404: it exited on its own meanwhile
                log.warning("job %s attempt %s: kill: %s", handle.job_id, handle.attempt, exc)
        except requests.RequestException as exc:
            log.warning("job %s attempt %s: kill: %s", handle.job_id, handle.attempt, exc)

    def signal(self, handle: SandboxHandle, name: str) -> None:
        """Send the container's main process a signal by name (a checkpointing job's SIGUSR1)."""
        c = self._get(handle)
        if c is None or c.status != "running":
            return
        try:
            c.kill(signal=name)
        except docker.errors.APIError as exc:  # it exited meanwhile
            log.info("job %s attempt %s: %s: %s", handle.job_id, handle.attempt, name, exc)

    def list_own(self) -> list[tuple[str, int, SandboxHandle]]:
        out = []
        for c in self.client.containers.list(all=True, filters={"label": [f"{LABEL_NODE}={self.node}"]}):
            lb = c.labels
            if lb.get(LABEL_INSTALLATION, "") != self.installation:
                continue  # another installation's agent with our node name, on the same engine
            try:
                job_id, attempt = lb[LABEL_JOB], int(lb[LABEL_ATTEMPT])
                limit = float(lb[LABEL_TIME_LIMIT]) if LABEL_TIME_LIMIT in lb else None
                gpus = [int(i) for i in lb.get(LABEL_GPUS, "").split(",") if i]
            except (KeyError, ValueError):
                log.warning("container %s has our node label but bad job labels %s", c.short_id, lb)
                continue
            started = _parse_ts(c.attrs["State"].get("StartedAt")) or time.time()
            out.append((job_id, attempt, SandboxHandle(
                driver=self.name, ref=c.id, job_id=job_id, attempt=attempt,
                started_at=started, time_limit_s=limit, gpu_indexes=gpus)))
        if out:
            self.ensure_supervisor()  # adopted containers are fenced too, even if their supervisor was killed
        return out

    def remove(self, handle: SandboxHandle) -> None:
        self._force_remove(handle.ref)
        self._logs.pop(handle.ref, None)
        self._polled.pop(handle.ref, None)
        self._oom_checked.pop(handle.ref, None)
        outputs = self.outputs_dir(handle)
        if outputs:  # uploaded (or given up) by now: the agent removes a sandbox after its report
            shutil.rmtree(outputs, ignore_errors=True)
        forget_fenced(self.lease_path, handle.ref)
        rec = self._session_record(handle.ref)
        if rec is not None:
            shutil.rmtree(rec["dir"], ignore_errors=True)
            self._forget_session_record(handle.ref)
        for net in self._networks_named(gang_network_name(handle.job_id, handle.attempt)):
            try:
                net.reload()
            except (docker.errors.APIError, requests.RequestException):
                continue  # another part of the gang removed it first (NotFound is an APIError)
            if not net.attrs.get("Containers"):
                self._remove_network(net)

    # -- helpers --------------------------------------------------------------

    def ensure_supervisor(self) -> None:
        """Start the node's supervisor unless one holds its lock (``supervisor.lock`` beside the lease
        file): a flock, taken here and handed to the new process, so a check costs no engine call and
        no process, and a supervisor about to end (lease out, no container left) either sees the lease
        the agent renewed before this check or leaves the lock free for it."""
        if self.lease_path is None:
            return
        import fcntl

        with self._supervisor_lock:
            fd = os.open(self.lease_path.parent / "supervisor.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # running
                if self.node_supervisor is not None:
                    self.node_supervisor.poll()  # the last one ended: reap it
                self.node_supervisor = supervisor.start(
                    "docker-node", self.node, self.lease_path, self.lease_s, self.fence_grace_s,
                    "--installation", self.installation, "--lock-fd", str(fd), pass_fds=(fd,))
            finally:
                os.close(fd)  # the supervisor holds the lock through its own copy

    def _get(self, handle_or_id):
        ref = handle_or_id.ref if isinstance(handle_or_id, SandboxHandle) else handle_or_id
        try:
            return self.client.containers.get(ref)
        except docker.errors.NotFound:
            return None

    def _force_remove(self, ref: str) -> None:
        try:
            self.client.api.remove_container(ref, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            log.warning("could not remove container %s: %s", ref[:12], exc)


class DockerShell:
    """Starts terminals in one container for the session gateway (agents/sessions.py)."""

    ARGV = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi"]

    def __init__(self, client, container_id: str):
        self.client, self.container_id = client, container_id

    def spawn(self) -> "DockerTerminal":
        api = self.client.api
        exec_id = api.exec_create(self.container_id, self.ARGV, stdin=True, tty=True, workdir="/work",
                                  environment={"TERM": "xterm-256color"})["Id"]
        sock = api.exec_start(exec_id, tty=True, socket=True)
        return DockerTerminal(api, exec_id, getattr(sock, "_sock", sock), self.container_id)


class DockerTerminal:
    """One ``docker exec`` with a TTY: its attach socket carries the terminal's bytes both ways."""

    def __init__(self, api, exec_id: str, sock, container_id: str):
        self.api, self.exec_id, self.sock, self.container_id = api, exec_id, sock, container_id
        self.fd = sock.fileno()

    def resize(self, cols: int, rows: int) -> None:
        try:
            self.api.exec_resize(self.exec_id, height=rows, width=cols)
        except docker.errors.APIError as exc:  # the shell ended meanwhile
            log.debug("exec %s: resize: %s", self.exec_id[:12], exc)

    def close(self) -> None:
        import socket

        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        # The shell does not notice the attach going away: hang it up as a terminal would (from inside the
        # container where the agent is not root).
        from agents.sandbox.docker_sessions import signal_exec

        signal_exec(self.api, self.container_id, self.exec_id, signal.SIGHUP)


def _give(path: str, uid: int, mode: int) -> bool:
    """Make ``path`` the job's (True), or, for an agent not run as root, open to it (False)."""
    try:
        os.chown(path, uid, uid, follow_symlinks=False)
        return True
    except PermissionError:
        os.chmod(path, mode | (0o077 if mode & 0o100 else 0o066))
        return False


def gang_rank(spec: LaunchSpec) -> int | None:
    """This part's rank when it belongs on a job-private network, else None."""
    return node_rank(spec) if spec.network else None


def bridge_name(network: str) -> str:
    """The host-side bridge of one of our networks: at most 15 characters, as Linux interface names."""
    return BRIDGE_PREFIX + hashlib.sha256(network.encode()).hexdigest()[:11]


def gang_network_name(job_id: str, attempt: int) -> str:
    return sandbox_name(job_id, attempt).replace("gpuportal-", "gpuportal-job-", 1)


def _parse_ts(s: str | None) -> float | None:
    """Docker's RFC 3339 timestamps carry nanoseconds and a zone (``Z`` or an
    offset: network timestamps are in the engine's local time); Python takes
    microseconds."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?", s or "")
    if not m or s.startswith("0001-"):
        return None
    head, frac, zone = m.groups()
    zone = "+00:00" if zone in (None, "Z") else zone
    try:
        dt = datetime.datetime.fromisoformat(head + zone)
    except ValueError:
        return None
    return dt.timestamp() + (float("0." + frac[:6]) if frac else 0.0)
