"""``python -m agents.supervisor docker CONTAINER --lease-file PATH --lease-s S --grace-s G``: the
per-container supervisor of the docker sandbox, a detached process of its own session that outlives
the agent. It waits on the container and, once the node's lease file says the lease ran out, stops it
(SIGTERM, SIGKILL after the fence grace), first noting it in ``fenced/<container>`` beside the lease
file (the engine keeps the exit code; the marker tells a returning agent the lease ended it).
It ends when the container has ended or is gone.

``python -m agents.supervisor kvm DOMAIN --uri URI ...`` does the same for a kvm sandbox's VM: the
ACPI power button (the guest's acpid SIGTERMs the job), then ``virsh destroy`` after the grace."""

import argparse
import sys
import time

from agents.supervisor.lease import CHECK_S, Lease, mark_fenced

LIVE = ("created", "running", "paused", "restarting")
STATUS_EVERY = 4  # the container's state is asked every STATUS_EVERY * CHECK_S; the lease file every CHECK_S


def watch(alive, lease: Lease, what: str) -> bool:
    """Wait until ``alive()`` (asked every STATUS_EVERY turns) says False, or the lease runs out (then
    True, after saying so on stderr)."""
    n = 0
    while True:
        if n % STATUS_EVERY == 0 and not alive():
            return False
        n += 1
        if lease.expired():
            print(f"gpuportal supervisor: the node's lease ran out at {time.ctime(lease.deadline)}; stopping "
                  f"{what} (fence grace {lease.grace_s:g}s)", file=sys.stderr, flush=True)
            return True
        time.sleep(CHECK_S)


def supervise_container(container_id: str, lease: Lease, client=None) -> str:
    """Returns how it ended: ``exited`` (the container ended or went) or ``fenced``."""
    import docker
    import docker.errors

    client = client or docker.from_env(timeout=30)

    def alive() -> bool:
        try:
            return client.containers.get(container_id).status in LIVE
        except docker.errors.NotFound:
            return False
    if not watch(alive, lease, f"container {container_id[:12]}"):
        return "exited"
    mark_fenced(lease.path, container_id)
    try:
        c = client.containers.get(container_id)
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


def supervise_domain(name: str, uri: str, lease: Lease) -> str:
    """As ``supervise_container``, for a libvirt domain: the ACPI power button until the grace, then destroy."""
    import libvirt

    conn = libvirt.open(uri)

    def alive() -> bool:
        try:
            return bool(conn.lookupByName(name).isActive())
        except libvirt.libvirtError:  # gone (a transient domain is undefined when it ends)
            return False
    if not watch(alive, lease, f"VM {name}"):
        return "exited"
    mark_fenced(lease.path, name)
    end = time.monotonic() + lease.grace_s
    try:
        dom = conn.lookupByName(name)
        while dom.isActive() and time.monotonic() < end:
            dom.shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        dom.destroy()
    except libvirt.libvirtError:
        pass  # it ended meanwhile
    return "fenced"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.supervisor", description=__doc__)
    ap.add_argument("kind", choices=["docker", "kvm"])
    ap.add_argument("sandbox", help="the container id, or the VM's domain name")
    ap.add_argument("--uri", default="qemu:///system", help="libvirt's (kvm)")
    ap.add_argument("--lease-file", required=True)
    ap.add_argument("--lease-s", type=float, default=60.0, help="the deadline from now while the file is missing")
    ap.add_argument("--grace-s", type=float, default=3.0, help="SIGTERM grace while the file is missing")
    args = ap.parse_args(argv)
    lease = Lease(args.lease_file, args.lease_s, args.grace_s)
    if args.kind == "docker":
        supervise_container(args.sandbox, lease)
    else:
        supervise_domain(args.sandbox, args.uri, lease)
    return 0


if __name__ == "__main__":
    sys.exit(main())
