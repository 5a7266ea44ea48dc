"""Node agents as processes on this machine: the `local` provider's machines.

Each node is one `python -m agents` process with simulated GPUs, in its own session (it outlives
whichever worker started it), with its folder under AUTOSCALE_LOCAL_ROOT/<name>/: `pid`, the
agent's `agent.log` and its `state/`. The token travels in the environment, never in argv.

Also a command line, so a `command` pool's scripts can start and stop the same agents:

    python -m portal.autoscale.localnode start NAME   # token, portal, broker, GPUs from the environment
    python -m portal.autoscale.localnode stop NAME
    python -m portal.autoscale.localnode list
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _defaults() -> tuple[Path, str, str, str]:
    """(root folder, broker URL, broker folder or "", volumes root) from the portal's settings."""
    # Only the local provider, inside the portal, reads the settings: the command line runs without Django.
    from django.conf import settings

    folder = ""
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        folder = settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]
    return Path(settings.AUTOSCALE_LOCAL_ROOT), settings.CELERY_BROKER_URL, folder, str(settings.VOLUMES_ROOT)


def _alive(pid: int) -> bool:
    """Running and not a zombie (an agent whose parent worker has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pid(folder: Path) -> int | None:
    try:
        return int((folder / "pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _is_agent(pid: int, name: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"agents" in argv and name.encode() in argv


def start(name: str, *, token: str, portal_url: str, gpus: str, sandbox: str = "process",
          root: Path | None = None, broker: str | None = None, broker_folder: str | None = None,
          volumes_root: str | None = None) -> int:
    """Start node `name`'s agent; returns its pid. A node whose agent already runs is left as is."""
    if root is None or broker is None:
        d_root, d_broker, d_folder, d_volumes = _defaults()
        root, broker = root or d_root, broker or d_broker
        broker_folder = d_folder if broker_folder is None else broker_folder
        volumes_root = d_volumes if volumes_root is None else volumes_root
    folder = Path(root) / name
    (folder / "state").mkdir(parents=True, exist_ok=True)
    pid = _pid(folder)
    if pid and _alive(pid) and _is_agent(pid, name):
        return pid
    argv = [sys.executable, "-m", "agents", "--portal", portal_url, "--broker", broker, "--name", name,
            "--gpus", gpus, "--sandbox", sandbox, "--state-dir", str(folder / "state"), "--stop-grace", "2",
            "--concurrency", "2", "--gpu-scrub", "off"]
    if broker_folder:
        argv += ["--broker-folder", broker_folder]
    if volumes_root:
        argv += ["--volumes-root", volumes_root]
    env = {**os.environ, "GPUPORTAL_NODE_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    with open(folder / "agent.log", "ab") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    (folder / "pid").write_text(f"{proc.pid}\n")
    # Until the new program has set up its arguments, /proc shows none: wait for them, so that
    # running() and stop() know the agent from the moment start() returns.
    deadline = time.monotonic() + 10
    while not _is_agent(proc.pid, name) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.pid


def stop(name: str, *, root: Path | None = None, grace_s: float = 15.0) -> bool:
    """Stop node `name`'s agent (SIGTERM to its session, SIGKILL after `grace_s`); True if it ran."""
    folder = Path(root or _defaults()[0]) / name
    pid = _pid(folder)
    if not pid or not _alive(pid) or not _is_agent(pid, name):
        (folder / "pid").unlink(missing_ok=True)
        return False
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _alive(pid):
            try:  # our own child (started by this process): reap it
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
        if not _alive(pid):
            break
    (folder / "pid").unlink(missing_ok=True)
    return True


def running(root: Path | None = None) -> dict[str, int]:
    """Nodes whose agent runs now: name -> pid."""
    base = Path(root or _defaults()[0])
    out = {}
    if base.is_dir():
        for folder in sorted(base.iterdir()):
            pid = _pid(folder)
            if pid and _alive(pid) and _is_agent(pid, folder.name):
                out[folder.name] = pid
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m portal.autoscale.localnode")
    ap.add_argument("action", choices=["start", "stop", "list"])
    ap.add_argument("name", nargs="?")
    ap.add_argument("--root", default=os.environ.get("GPUPORTAL_LOCAL_NODES", str(ROOT / "var" / "autoscale")))
    args = ap.parse_args(argv)
    env = os.environ.get
    if args.action == "list":
        for name, pid in running(Path(args.root)).items():
            print(name, pid)
        return 0
    if not args.name:
        ap.error("a node name is needed")
    if args.action == "stop":
        stop(args.name, root=Path(args.root))
        return 0
    print(start(args.name, token=env("GPUPORTAL_NODE_TOKEN", ""), portal_url=env("GPUPORTAL_PORTAL_URL", ""),
                gpus=env("GPUPORTAL_SIM_GPUS", "sim:1xH100-80GB"), sandbox=env("GPUPORTAL_SANDBOX", "process"),
                root=Path(args.root), broker=env("CELERY_BROKER_URL", ""),
                broker_folder=env("GPUPORTAL_BROKER_FOLDER", ""), volumes_root=env("GPUPORTAL_VOLUMES_ROOT", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
