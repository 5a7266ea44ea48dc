"""Process "sandbox": a plain subprocess, for machines without Docker.

It isolates nothing: the job runs as the agent's user with the agent's view
of the machine. It exists so a laptop can run the whole stack, and it warns at
every start. Each job gets its own session (so its own process group, which
``stop`` signals as a whole), a scratch directory and a log file.

A small JSON record per sandbox under ``state_dir`` lets a restarted agent
find jobs it started (``list_own``); their exit codes are lost with the
parent, so an adopted job that ends reports no exit code.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from agents.sandbox import EXITED, RUNNING, LaunchSpec, SandboxError, SandboxHandle, job_env, sandbox_name
from agents.sandbox.volumes import MOUNT_ROOT, VolumePathError, plan_mounts

log = logging.getLogger(__name__)

LOG_READ_MAX_BYTES = 1024 * 1024  # one read_logs call returns at most this; the agent reads on


class ProcessDriver:
    name = "process"

    def __init__(self, *, node: str, state_dir: str | None = None):
        self.node = node
        self.state_dir = Path(state_dir or Path(tempfile.gettempdir()) / f"gpuportal-process-{node}")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._children: dict[str, subprocess.Popen] = {}

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        log.warning(
            "PROCESS SANDBOX: job %s attempt %s runs as a plain process with NO ISOLATION "
            "(no network, memory, GPU or filesystem confinement). Use --sandbox docker on shared machines.",
            spec.job_id, spec.attempt)
        ref = sandbox_name(spec.job_id, spec.attempt)
        root = self.state_dir / ref
        try:
            root.mkdir()
        except FileExistsError:
            raise SandboxError(f"sandbox {ref} already exists") from None
        workdir = root / "work"
        workdir.mkdir()
        # A bare process sees the host's GPU numbering, so pass host indexes.
        env = job_env(spec, visible_devices=[str(i) for i in spec.gpu_indexes])
        env.update(PATH=os.environ.get("PATH", "/usr/bin:/bin"), HOME=str(workdir), TMPDIR=str(workdir))
        # Nothing to mount into: the job is told where its volumes and checkpoint folder are on the host
        # (GPUPORTAL_VOLUME_<NAME>; read-only is not enforced here, like nothing else is).
        try:
            binds, _, checkpoint_dir = plan_mounts(os.environ.get("GPUPORTAL_VOLUMES_ROOT", ""), spec.volumes,
                                                   spec.checkpoint, owner=None)
        except (VolumePathError, OSError) as exc:
            shutil.rmtree(root, ignore_errors=True)
            raise SandboxError(f"volumes: {exc}") from None
        for host, container, _ in binds:
            if container.startswith(MOUNT_ROOT + "/"):
                env["GPUPORTAL_VOLUME_" + container.rsplit("/", 1)[1].upper().replace("-", "_")] = host
        if checkpoint_dir:
            env["GPUPORTAL_CHECKPOINT_DIR"] = checkpoint_dir
        with open(root / "log", "wb") as logf:
            try:
                p = subprocess.Popen(spec.command, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                shutil.rmtree(root, ignore_errors=True)
                raise SandboxError(f"could not start {spec.command[0]!r}: {exc}") from None
        handle = SandboxHandle(driver=self.name, ref=ref, job_id=spec.job_id, attempt=spec.attempt,
                               started_at=time.time(), time_limit_s=spec.time_limit_s,
                               gpu_indexes=list(spec.gpu_indexes))
        (root / "record.json").write_text(json.dumps({
            "job_id": spec.job_id, "attempt": spec.attempt, "pid": p.pid,
            "start_ticks": _start_ticks(p.pid), "started_at": handle.started_at,
            "time_limit_s": spec.time_limit_s, "node": self.node, "gpu_indexes": spec.gpu_indexes,
        }))
        self._children[ref] = p
        return handle

    def poll(self, handle: SandboxHandle) -> tuple[str, int | None]:
        p = self._children.get(handle.ref)
        if p is not None:
            rc = p.poll()
            if rc is None:
                return RUNNING, None
            # Report a signal death the way a shell (and Docker) does: 128 + signal.
            return EXITED, (128 - rc if rc < 0 else rc)
        rec = self._record(handle.ref)
        if rec and _alive(rec["pid"], rec.get("start_ticks")):
            return RUNNING, None
        return EXITED, None

    def read_logs(self, handle: SandboxHandle, offset: int) -> bytes:
        try:
            with open(self.state_dir / handle.ref / "log", "rb") as f:
                f.seek(offset)
                return f.read(LOG_READ_MAX_BYTES)
        except FileNotFoundError:
            return b""

    def stop(self, handle: SandboxHandle, grace_s: float) -> None:
        """SIGTERM the job's process group, wait up to ``grace_s``, then SIGKILL it."""
        rec = self._record(handle.ref)
        if not rec or self.poll(handle)[0] != RUNNING:
            return
        pgid = rec["pid"]  # start_new_session: the leader's pid is the group id
        _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, grace_s)
        while time.monotonic() < deadline:
            if self.poll(handle)[0] != RUNNING:
                break
            time.sleep(0.05)
        # Kill the group even if the leader exited: it may have left children.
        _killpg(pgid, signal.SIGKILL)
        p = self._children.get(handle.ref)
        if p is not None:
            p.wait()

    def list_own(self) -> list[tuple[str, int, SandboxHandle]]:
        out = []
        for rec_path in sorted(self.state_dir.glob("*/record.json")):
            try:
                rec = json.loads(rec_path.read_text())
            except (OSError, ValueError):
                continue
            handle = SandboxHandle(driver=self.name, ref=rec_path.parent.name, job_id=rec["job_id"],
                                   attempt=rec["attempt"], started_at=rec["started_at"],
                                   time_limit_s=rec.get("time_limit_s"),
                                   gpu_indexes=rec.get("gpu_indexes", []))
            out.append((rec["job_id"], rec["attempt"], handle))
        return out

    def remove(self, handle: SandboxHandle) -> None:
        if self.poll(handle)[0] == RUNNING:
            self.stop(handle, 0)
        self._children.pop(handle.ref, None)
        shutil.rmtree(self.state_dir / handle.ref, ignore_errors=True)

    def _record(self, ref: str) -> dict | None:
        try:
            return json.loads((self.state_dir / ref / "record.json").read_text())
        except (OSError, ValueError):
            return None


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks: with the pid, it names one process
    even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start_ticks: int | None) -> bool:
    now = _start_ticks(pid)
    if now is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and (start_ticks is None or now == start_ticks)
