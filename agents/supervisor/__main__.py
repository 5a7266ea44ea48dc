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
            _say_fenced(lease, what)
            return True
        time.sleep(CHECK_S)


def _say_fenced(lease: Lease, what: str) -> None:
    print(f"gpuportal supervisor: the node's lease ran out at {time.ctime(lease.deadline)}; stopping "
          f"{what} (fence grace {lease.grace_s:g}s)", file=sys.stderr, flush=True)


class EngineSocket:
    """The three Docker Engine API calls a supervisor makes (wait, inspect, kill), over the engine's
    UNIX socket with the standard library: importing the docker SDK cost every job's supervisor about
    0.1 s of CPU, and asking for the container's state every 2 s some more. ``wait`` is one request
    the engine answers when the container ends, so a running job costs its supervisor nothing."""

    def __init__(self, path: str):
        self.path = path

    def call(self, method: str, url: str, timeout: float | None = 30.0) -> tuple[int, bytes]:
        """(HTTP status, body). HTTP/1.0 by hand: the engine answers and closes; http.client would
        import the email package, a third of this process's start-up."""
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(self.path)
            sock.sendall(f"{method} {url} HTTP/1.0\r\nHost: docker\r\nContent-Length: 0\r\n\r\n".encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        try:
            return int(head.split(None, 2)[1]), body
        except (IndexError, ValueError):
            raise OSError(f"the engine's answer is not HTTP: {head[:60]!r}") from None


def engine_socket() -> EngineSocket | None:
    """The engine's UNIX socket as DOCKER_HOST names it (unset: the default one); None for any other
    transport (tcp, TLS, ssh), which the docker SDK serves."""
    import os

    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    return EngineSocket(host[len("unix://"):]) if host.startswith("unix://") else None


def supervise_container_socket(container_id: str, lease: Lease, engine: EngineSocket) -> str:
    """``supervise_container`` on the engine's socket: a thread waits for the container's end (one
    request; asked again after a broken connection, as when the engine restarts), the main loop reads
    the lease file every CHECK_S."""
    import json
    import threading

    ended = threading.Event()

    def wait_for_end():
        while True:
            try:
                status, _ = engine.call("POST", f"/containers/{container_id}/wait?condition=not-running", None)
                if status == 404:
                    break  # gone
                if status == 200:
                    code, body = engine.call("GET", f"/containers/{container_id}/json")
                    if code == 404 or json.loads(body or b"{}").get("State", {}).get("Status") not in LIVE:
                        break
            except (OSError, ValueError):  # the engine restarts, or answered nonsense: ask again
                pass
            time.sleep(1.0)
        ended.set()

    threading.Thread(target=wait_for_end, daemon=True).start()
    while not ended.wait(CHECK_S):
        if lease.expired():
            _say_fenced(lease, f"container {container_id[:12]}")
            break
    else:
        return "exited"
    mark_fenced(lease.path, container_id)
    for signal, wait_s in (("SIGTERM", lease.grace_s), ("SIGKILL", 0.0)):
        try:
            engine.call("POST", f"/containers/{container_id}/kill?signal={signal}")  # 404/409: it ended meanwhile
        except OSError:
            pass
        if ended.wait(wait_s):
            break
    return "fenced"


def supervise_container(container_id: str, lease: Lease, client=None) -> str:
    """Returns how it ended: ``exited`` (the container ended or went) or ``fenced``."""
    engine = engine_socket() if client is None else None
    if engine is not None:
        return supervise_container_socket(container_id, lease, engine)
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
