"""Process "sandbox": a plain subprocess, for machines without Docker.

It isolates nothing: the job runs as the agent's user with the agent's view
of the machine. It exists so a laptop can run the whole stack, and it warns at
every start. Each job gets its own session (so its own process group, which
``stop`` signals as a whole), a scratch directory and a log file.

Each job's folder lives in the agent's state folder (``<state>/process-<node>``,
made 0700 and never followed through a link: ``kvm_domain.driver_dir``), with a
small JSON record that lets a restarted agent find the jobs it started
(``list_own``). The job runs under a small per-job supervisor (``WRAPPER``,
agents/supervisor/lease.py), forked for each launch by the node's process spawner
(``Spawner``, one long-lived process per agent: a fork costs a fraction of a new
interpreter's start), that waits for it and writes its exit code to
``exit`` in that folder (atomically, by rename) before it exits itself, so a
job that ends while no agent is its parent (the agent restarted) still has its
real exit code for the adopting agent. The supervisor also reads the node's
lease file (``lease`` in the same folder) and kills the job once the lease has
run out, agent alive or not; the exit record then says ``lease_expired``. A job
killed with its wrapper (SIGKILL to the group) leaves no code: it reads as
unknown. The job runs as the agent's user and could write that file itself:
this sandbox fences nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from agents.sandbox import EXITED, RUNNING, LaunchSpec, SandboxError, SandboxHandle, job_env, sandbox_name
from agents.sandbox.kvm_domain import driver_dir
from agents.sandbox.volumes import MOUNT_ROOT, VolumePathError, plan_mounts
from agents.supervisor import SOURCE as SUPERVISOR_SOURCE
from agents.supervisor.lease import FENCED

log = logging.getLogger(__name__)

LOG_READ_MAX_BYTES = 1024 * 1024  # one read_logs call returns at most this; the agent reads on
REAP_WAIT_S = 1.0  # how long poll waits for the spawner's exit record of a supervisor killed first

# The job's parent is the per-job supervisor (agents/supervisor/lease.py), forked by the node's spawner,
# which runs with -I -S (no PYTHON* variables from the agent's environment, no site, nothing of the agent
# importable): it waits for the job, writes its exit code, and fences the job when the node's lease
# file says the lease ran out.
WRAPPER = SUPERVISOR_SOURCE


class ProcessDriver:
    name = "process"

    def __init__(self, *, node: str, state_dir: str | None = None):
        self.node = node
        # state_dir is the agent's (--state-dir); the driver's own folder is made private in it.
        self.state_dir = driver_dir("process", node, state_dir)
        self._spawner = Spawner()
        self._spawned: dict[str, tuple[int, int | None]] = {}  # ref -> (pid, start ticks) of our launches
        # The node's lease, written by the agent after each renewal and read by every job's supervisor;
        # lease_s and fence_grace_s (set by the agent from its registration) stand in until it exists.
        self.lease_path = self.state_dir / "lease"
        self.lease_s, self.fence_grace_s = 60.0, 3.0
        self._exits: ExitWatcher | None = None

    def close(self) -> None:
        """End the node's spawner (the jobs it started live on)."""
        self._spawner.close()

    def watch_exits(self, ended) -> None:
        """Call ``ended(ref)`` as soon as a job's supervisor process exits (a pidfd per job, one
        thread for all), for the jobs running now and every later launch."""
        self._exits = ExitWatcher(ended)
        for _, _, handle in self.list_own():
            rec = self._record(handle.ref)
            if rec and _alive(rec["pid"], rec.get("start_ticks")):
                self._exits.add(handle.ref, rec["pid"])

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
            if not self._unfinished_launch_cleared(root, spec):
                raise SandboxError(f"sandbox {ref} already exists") from None
            root.mkdir()
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
        for name, host in spec.dataset_paths.items():  # the cache's folder (read-only by its modes)
            env["GPUPORTAL_DATASET_" + name.upper().replace("-", "_").replace(".", "_")] = host
        if spec.outputs:  # no /outputs to mount: the job is told its host folder
            (root / "outputs").mkdir()
            env["GPUPORTAL_OUTPUTS_DIR"] = str(root / "outputs")
        sessions_dir = _publish_sessions(spec, env) if spec.sessions else None
        exe = spec.command[0]
        found = os.access(workdir / exe, os.X_OK) if "/" in exe else shutil.which(exe, path=env["PATH"])
        if not found:  # said here, at launch, rather than as the wrapper's exit code 127
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(sessions_dir or root, ignore_errors=True)
            raise SandboxError(f"could not start {exe!r}: no such executable")
        try:
            pid = self._spawner.spawn({
                "exit": str(root / "exit"), "lease": str(self.lease_path), "lease_s": self.lease_s,
                "grace_s": self.fence_grace_s, "cwd": str(workdir), "log": str(root / "log"), "env": env,
                "argv": list(spec.command)}, workdir)
        except SandboxError as exc:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(sessions_dir or root, ignore_errors=True)
            raise SandboxError(f"could not start {exe!r}: {exc}") from None
        handle = SandboxHandle(driver=self.name, ref=ref, job_id=spec.job_id, attempt=spec.attempt,
                               started_at=time.time(), time_limit_s=spec.time_limit_s,
                               gpu_indexes=list(spec.gpu_indexes))
        ticks = _start_ticks(pid)
        (root / "record.json.tmp").write_text(json.dumps({
            "job_id": spec.job_id, "attempt": spec.attempt, "pid": pid,
            "start_ticks": ticks, "started_at": handle.started_at,
            "time_limit_s": spec.time_limit_s, "node": self.node, "gpu_indexes": spec.gpu_indexes,
            "sessions": spec.sessions, "sessions_dir": sessions_dir, "env": env if spec.sessions else None,
        }))
        os.replace(root / "record.json.tmp", root / "record.json")  # list_own never reads half a record
        self._spawned[ref] = (pid, ticks)
        if self._exits is not None:
            self._exits.add(ref, pid)
        return handle

    def _unfinished_launch_cleared(self, root: Path, spec: LaunchSpec) -> bool:
        """The sandbox folder of this attempt exists. With its record, it is a sandbox (the agent
        adopts it): False. Without one, an agent died inside launch(), between the folder and
        the record. If the wrapper had started (a session leader working in the folder's work/),
        it runs the job: its record is written now, for the agent to adopt it (False), so the job
        does not run twice. If not, nothing started: the half-made folder is removed (True)."""
        if (root / "record.json").exists():
            return False
        pid = _session_leader_in(str(root / "work"))
        if pid is not None:
            log.warning("job %s attempt %s: an agent died while starting it; adopting its process %d",
                        spec.job_id, spec.attempt, pid)
            (root / "record.json.tmp").write_text(json.dumps({
                "job_id": spec.job_id, "attempt": spec.attempt, "pid": pid, "start_ticks": _start_ticks(pid),
                "started_at": root.stat().st_mtime, "time_limit_s": spec.time_limit_s, "node": self.node,
                "gpu_indexes": spec.gpu_indexes, "sessions": spec.sessions, "sessions_dir": None, "env": None}))
            os.replace(root / "record.json.tmp", root / "record.json")
            return False
        log.warning("job %s attempt %s: removing the sandbox folder an agent left half-made", spec.job_id,
                    spec.attempt)
        shutil.rmtree(root, ignore_errors=True)
        return True

    def poll(self, handle: SandboxHandle) -> tuple[str, int | None]:
        spawned = self._spawned.get(handle.ref)
        if spawned is None:  # adopted after a restart
            rec = self._record(handle.ref)
            spawned = (rec["pid"], rec.get("start_ticks")) if rec else None
        if spawned and _alive(*spawned):
            return RUNNING, None
        # The supervisor wrote the code before it exited; if it was killed first (SIGKILL to the
        # group), its spawner writes the code from the wait status as it reaps it: a moment later.
        code, fenced = self._exit_record(handle.ref)
        if code is None and spawned and self._spawner.spawned(spawned[0]):
            deadline = time.monotonic() + REAP_WAIT_S
            while code is None and time.monotonic() < deadline and self._spawner.alive():
                time.sleep(0.005)
                code, fenced = self._exit_record(handle.ref)
        return (FENCED if fenced else EXITED), code

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
        deadline = time.monotonic() + 5
        while _alive(pgid, rec.get("start_ticks")) and time.monotonic() < deadline:
            time.sleep(0.005)

    def signal(self, handle: SandboxHandle, name: str) -> None:
        """Send the job's process group a signal by name (a checkpointing job's SIGUSR1); the
        supervisor leading the group only notes it."""
        rec = self._record(handle.ref)
        if rec and self.poll(handle)[0] == RUNNING:
            _killpg(rec["pid"], getattr(signal, name))

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

    def outputs_dir(self, handle: SandboxHandle) -> str | None:
        """The host folder of the job's outputs (agents/artifacts.py), None when it has none."""
        folder = self.state_dir / handle.ref / "outputs"
        return str(folder) if folder.is_dir() else None

    def remove(self, handle: SandboxHandle) -> None:
        if self.poll(handle)[0] == RUNNING:
            self.stop(handle, 0)
        spawned = self._spawned.pop(handle.ref, None)
        if spawned is not None:
            self._spawner.forget(spawned[0])
        rec = self._record(handle.ref) or {}
        if rec.get("sessions_dir"):
            shutil.rmtree(rec["sessions_dir"], ignore_errors=True)
        shutil.rmtree(self.state_dir / handle.ref, ignore_errors=True)

    # -- interactive sessions (agents/sessions.py) ----------------------------------

    def session_specs(self, handle: SandboxHandle) -> list[dict]:
        return (self._record(handle.ref) or {}).get("sessions") or []

    def session_targets(self, handle: SandboxHandle, sessions: list[dict]) -> dict[str, tuple]:
        """JupyterLab on its unix socket; an HTTP app on the job's loopback port (this sandbox has no
        network namespace of its own: any local user could reach that port, like everything here)."""
        rec = self._record(handle.ref) or {}
        out = {}
        for s in sessions:
            if s["kind"] == "jupyter" and rec.get("sessions_dir"):
                out[s["name"]] = ("unix", os.path.join(rec["sessions_dir"], s["name"] + ".sock"))
            elif s["kind"] == "http":
                out[s["name"]] = ("tcp", "127.0.0.1", int(s["port"]))
        return out

    def session_shell(self, handle: SandboxHandle) -> tuple:
        """(argv, env, cwd) of a shell beside the job: its environment and working folder."""
        rec = self._record(handle.ref) or {}
        env = dict(rec.get("env") or {})
        env.setdefault("TERM", "xterm-256color")
        shell = shutil.which("bash", path=env.get("PATH")) or "/bin/sh"
        return [shell, "-i"], env, str(self.state_dir / handle.ref / "work")

    def _exit_record(self, ref: str) -> tuple[int | None, bool]:
        """(exit code, whether the supervisor fenced the job) from the wrapper's record."""
        try:
            code, *what = (self.state_dir / ref / "exit").read_text().split()
            return int(code), FENCED in what
        except (OSError, ValueError):
            return None, False  # killed with its wrapper, or gone: unknown

    def _record(self, ref: str) -> dict | None:
        try:
            return json.loads((self.state_dir / ref / "record.json").read_text())
        except (OSError, ValueError):
            return None


def _publish_sessions(spec: LaunchSpec, env: dict) -> str:
    """A private folder for the job's session sockets (short, so a socket path stays under the
    108 bytes AF_UNIX allows), JupyterLab's settings in it, and the session variables in ``env``."""
    import tempfile

    from agents.sessions import jupyter_config, session_env

    folder = tempfile.mkdtemp(prefix=f"gps-{spec.job_id}-")  # 0700
    sockets = {s["name"]: os.path.join(folder, s["name"] + ".sock") for s in spec.sessions
               if s["kind"] == "jupyter"}
    for s in spec.sessions:
        if s["kind"] == "jupyter":
            os.makedirs(os.path.join(folder, "jupyter"), mode=0o700, exist_ok=True)
            path = os.path.join(folder, "jupyter", "jupyter_server_config.json")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(jupyter_config(s, sockets[s["name"]]), f)
            env["JUPYTER_CONFIG_PATH"] = os.path.join(folder, "jupyter")
    env.update(session_env(spec.sessions, sockets))
    return folder


class Spawner:
    """The agent's end of the node's process spawner (agents/supervisor/lease.py, ``serve_spawns``):
    started at the first launch, and again if it has died; launches take turns on its pipe."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pids: set[int] = set()

    def spawn(self, request: dict, workdir: Path) -> int:
        """The pid of the job's supervisor, forked by the spawner. SandboxError if none started."""
        line = json.dumps(request).encode() + b"\n"
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                proc = self._start()
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except OSError:  # it died since: it had the request from nobody, so start one and ask again
                proc = self._start()
                proc.stdin.write(line)
                proc.stdin.flush()
            answer = proc.stdout.readline().decode().strip()
            if answer.isdigit():
                self._pids.add(int(answer))
                return int(answer)
        if answer:
            raise SandboxError(f"the node's process spawner refused: {answer}")
        # It died with the request: its child, if it forked one, is the session leader working in
        # workdir. Found, it is the job (started once); not found, nothing started.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            pid = _session_leader_in(str(workdir))
            if pid is not None:
                return pid
            time.sleep(0.02)
        raise SandboxError("the node's process spawner ended without starting the job")

    def spawned(self, pid: int) -> bool:
        """Whether the spawner running now forked ``pid`` (so it will write its exit record)."""
        return pid in self._pids

    def forget(self, pid: int) -> None:
        """The sandbox of ``pid`` is gone: no need to remember it (an agent runs millions of jobs)."""
        self._pids.discard(pid)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.stdin.close()
                try:
                    self._proc.wait(5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc.stdout.close()
                self._proc = None

    def _start(self) -> subprocess.Popen:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._pids = set()  # a new spawner writes no record for the old one's children
        try:
            # In the agent's group (a signal to the agent's group ends it; its children have sessions
            # of their own), its stderr the agent's.
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", WRAPPER, "spawner"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as exc:
            self._proc = None
            raise SandboxError(f"the node's process spawner did not start: {exc}") from None
        return self._proc


class ExitWatcher:
    """One thread that waits on a pidfd per process (Linux 5.3+) and calls ``ended(ref)`` when one
    exits: the agent learns of an exit at once instead of at its next poll. Where pidfds are not
    available it watches nothing and the agent's ticks notice exits as before."""

    def __init__(self, ended):
        import selectors
        import threading

        self.ended = ended
        self.selector = selectors.DefaultSelector()
        self.thread = threading.Thread(target=self._run, name="process-exits", daemon=True)
        self.thread.start()

    def add(self, ref: str, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds here, or the process is gone already
            self.ended(ref)
            return
        self.selector.register(fd, 1, ref)  # EVENT_READ: the process has exited

    def _run(self) -> None:
        while True:
            # epoll: a pidfd added meanwhile is waited on at once, without waking this call.
            try:
                ready = self.selector.select(timeout=1.0)
            except OSError:
                ready = []
            for key, _ in ready:
                self.selector.unregister(key.fd)
                os.close(key.fd)
                try:
                    self.ended(key.data)
                except Exception:  # the agent's ticks still notice it
                    log.exception("exit of %s: notifying the agent failed", key.data)


def _session_leader_in(workdir: str) -> int | None:
    """The pid of a session leader working in ``workdir`` (a job's supervisor), if one runs."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        try:
            if os.readlink(proc / "cwd") == workdir and os.getsid(pid) == pid:
                return pid
        except OSError:
            continue
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
