"""Supervisors that fence a node's jobs without a live agent (the role containerd-shim or conmon play
for a container): one per process-sandbox job and per VM, one per node for the docker sandbox.

The agent writes the node's lease to a file (``lease.write_lease``) after every heartbeat the portal
took (and on its outage answer): the wall-clock deadline, the moment the last renewing request was
sent plus the lease. Each job runs under a small supervisor process of its own session that outlives
the agent: it re-reads that file every half second and, once the deadline has passed, stops the job
(SIGTERM, then SIGKILL after the fence grace) and records the end as ``lease_expired``. The portal
re-places a silent node's jobs only after the lease, the fence grace and a margin (NODE_TIMEOUT_S), so
the old attempt is dead before the new one starts, whether the agent is alive, frozen or gone.

``lease.py`` uses the standard library only: the process sandbox runs it with ``python -I -S -c`` as the
node's spawner of the jobs' parents (``SOURCE``), where nothing of the agent's packages is importable.
"""

import os
import sys

# os.path, not pathlib: each job's supervisor imports this package, and pathlib (with the fnmatch and
# urllib it pulls in) was a third of its start-up CPU.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # ``agents`` imports from here


def __getattr__(name: str) -> str:
    """``SOURCE``, lease.py's text (the process sandbox's job parent), read when first asked for."""
    if name == "SOURCE":
        with open(os.path.join(os.path.dirname(__file__), "lease.py")) as f:
            globals()["SOURCE"] = text = f.read()
        return text
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start(kind: str, ref: str, lease_path, lease_s: float, grace_s: float, *extra: str,
          pass_fds: tuple[int, ...] = ()) -> "subprocess.Popen":
    """Start ``python -m agents.supervisor KIND REF`` detached (a session of its own, so it outlives the
    agent and a signal to the agent's group); its messages go to ``supervisors.log`` beside the lease."""
    import subprocess  # here: the supervisor process imports this package and needs none of it

    with open(os.path.join(os.path.dirname(str(lease_path)), "supervisors.log"), "ab") as errf:
        return subprocess.Popen(
            [sys.executable, "-m", "agents.supervisor", kind, ref, "--lease-file", str(lease_path),
             "--lease-s", str(lease_s), "--grace-s", str(grace_s), *extra],
            env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True, pass_fds=pass_fds)
