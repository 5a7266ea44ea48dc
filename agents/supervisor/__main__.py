"""``python -m agents.supervisor docker CONTAINER --lease-file PATH --lease-s S --grace-s G``: the
per-container supervisor of the docker sandbox, a detached process of its own session that outlives
the agent. It waits on the container and, once the node's lease file says the lease ran out, stops it
(SIGTERM, SIGKILL after the fence grace). It writes nothing else: the engine keeps the exit code.
It ends when the container has ended or is gone."""

import argparse
import sys
import time

from agents.supervisor.lease import CHECK_S, Lease

LIVE = ("created", "running", "paused", "restarting")
STATUS_EVERY = 4  # the container's state is asked every STATUS_EVERY * CHECK_S; the lease file every CHECK_S


def supervise_container(container_id: str, lease: Lease, client=None) -> str:
    """Returns how it ended: ``exited`` (the container ended or went) or ``fenced``."""
    import docker
    import docker.errors

    client = client or docker.from_env(timeout=30)
    n = 0
    while True:
        if n % STATUS_EVERY == 0:
            try:
                c = client.containers.get(container_id)
            except docker.errors.NotFound:
                return "exited"
            if c.status not in LIVE:
                return "exited"
        n += 1
        if lease.expired():
            break
        time.sleep(CHECK_S)
    print(f"gpuportal supervisor: the node's lease ran out at {time.ctime(lease.deadline)}; stopping container "
          f"{container_id[:12]} (SIGTERM, SIGKILL after {lease.grace_s:g}s)", file=sys.stderr, flush=True)
    try:
        c.kill(signal="SIGTERM")
        c.wait(timeout=lease.grace_s)
    except docker.errors.NotFound:
        return "fenced"
    except Exception:  # still running after the grace (a read timeout), or exited between look and signal
        pass
    try:
        c.kill(signal="SIGKILL")
    except docker.errors.APIError:
        pass  # 404/409: it ended meanwhile
    return "fenced"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.supervisor", description=__doc__)
    ap.add_argument("kind", choices=["docker"])
    ap.add_argument("container")
    ap.add_argument("--lease-file", required=True)
    ap.add_argument("--lease-s", type=float, default=60.0, help="the deadline from now while the file is missing")
    ap.add_argument("--grace-s", type=float, default=3.0, help="SIGTERM grace while the file is missing")
    args = ap.parse_args(argv)
    supervise_container(args.container, Lease(args.lease_file, args.lease_s, args.grace_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
