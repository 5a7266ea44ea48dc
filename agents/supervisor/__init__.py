"""Per-job supervisors that fence a node's jobs without a live agent (the role containerd-shim or
conmon play for a container).

The agent writes the node's lease to a file (``lease.write_lease``) after every heartbeat the portal
took (and on its outage answer): the wall-clock deadline, the moment the last renewing request was
sent plus the lease. Each job runs under a small supervisor process of its own session that outlives
the agent: it re-reads that file every half second and, once the deadline has passed, stops the job
(SIGTERM, then SIGKILL after the fence grace) and records the end as ``lease_expired``. The portal
re-places a silent node's jobs only after the lease, the fence grace and a margin (NODE_TIMEOUT_S), so
the old attempt is dead before the new one starts, whether the agent is alive, frozen or gone.

``lease.py`` uses the standard library only: the process sandbox runs it with ``python -I -c`` as the
job's parent (``SOURCE``), where nothing of the agent's environment or packages is importable.
"""

import os
import sys
from pathlib import Path

SOURCE = (Path(__file__).with_name("lease.py")).read_text()
ROOT = str(Path(__file__).resolve().parents[2])  # where ``agents`` is importable from


def start(kind: str, ref: str, lease_path: Path, lease_s: float, grace_s: float, *extra: str) -> "subprocess.Popen":
    """Start ``python -m agents.supervisor KIND REF`` detached (a session of its own, so it outlives the
    agent and a signal to the agent's group); its messages go to ``supervisors.log`` beside the lease."""
    import subprocess  # here: the supervisor process imports this package and needs none of it

    with open(lease_path.parent / "supervisors.log", "ab") as errf:
        return subprocess.Popen(
            [sys.executable, "-m", "agents.supervisor", kind, ref, "--lease-file", str(lease_path),
             "--lease-s", str(lease_s), "--grace-s", str(grace_s), *extra],
            env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)
