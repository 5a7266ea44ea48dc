"""``python -m agents.supervisor docker-node NODE --lease-file PATH --lease-s S --grace-s G
[--installation I]``: the docker sandbox's node supervisor, one detached process per node (its own
session, so it outlives the agent) for all of that node's containers, as containerd is one daemon for
all its tasks. While the node's lease holds it only re-reads the lease file every half second: no
request to the engine, nothing per container. Once the lease has run out it lists the node's live
containers and stops each (SIGTERM, SIGKILL after the fence grace), first noting it in
``fenced/<container>`` beside the lease file (the engine keeps the exit code; the marker tells a
returning agent the lease ended it), and does so again for any that appears while the lease stays
out. It holds ``supervisor.lock`` beside the lease file, so a node has one; it ends when the lease has
run out and no live container of the node is left (the agent starts it again before its next launch).

``python -m agents.supervisor kvm DOMAIN --uri URI ...`` does the same for a kvm sandbox's VM: the
ACPI power button (the guest's acpid SIGTERMs the job), then ``virsh destroy`` after the grace."""

import argparse
import sys
import time

from agents.supervisor.lease import CHECK_S, Lease, mark_fenced

# The docker sandbox's labels (agents/sandbox/__init__.py), repeated: this process imports nothing of it.
LABEL_NODE, LABEL_INSTALLATION = "gpuportal.node", "gpuportal.installation"

LIVE = ("created", "running", "paused", "restarting")
STATUS_EVERY = 4  # a VM's state is asked every STATUS_EVERY * CHECK_S; the lease file every CHECK_S


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
    """The Docker Engine API calls the node supervisor makes (list, kill), over the engine's UNIX socket
    with the standard library: it needs two calls, and only once the lease has run out."""

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


class SocketContainers:
    """A node's containers through the engine's socket (``EngineSocket``): list the live ones, signal one."""

    def __init__(self, engine: EngineSocket, node: str, installation: str):
        self.engine, self.node, self.installation = engine, node, installation

    def live(self) -> list[str]:
        import json
        from urllib.parse import quote

        filters = json.dumps({"label": [f"{LABEL_NODE}={self.node}"]})
        status, body = self.engine.call("GET", f"/containers/json?all=1&filters={quote(filters)}")
        if status != 200:
            raise OSError(f"the engine answered {status} to the container list")
        return [c["Id"] for c in json.loads(body) if c.get("State") in LIVE
                and (c.get("Labels") or {}).get(LABEL_INSTALLATION, "") == self.installation]

    def kill(self, container_id: str, signal: str) -> None:
        self.engine.call("POST", f"/containers/{container_id}/kill?signal={signal}")  # 404/409: it ended meanwhile


class SdkContainers(SocketContainers):
    """The same through the docker SDK, for an engine reached over tcp, TLS or ssh."""

    def __init__(self, node: str, installation: str):
        import docker

        self.client, self.node, self.installation = docker.from_env(timeout=30), node, installation

    def live(self) -> list[str]:
        return [c.id for c in self.client.containers.list(all=True, filters={"label": [f"{LABEL_NODE}={self.node}"]})
                if c.status in LIVE and c.labels.get(LABEL_INSTALLATION, "") == self.installation]

    def kill(self, container_id: str, signal: str) -> None:
        import docker.errors

        try:
            self.client.api.kill(container_id, signal=signal)
        except docker.errors.APIError:
            pass  # 404/409: it ended meanwhile


class NodeLock:
    """``supervisor.lock`` beside the lease file, held (flock) by the node's one docker supervisor. The
    agent takes it before starting one and hands its descriptor over (``--lock-fd``), so there is no
    moment in which a launch could find it free while a supervisor runs."""

    def __init__(self, path: str, fd: int | None = None):
        self.path, self.fd = path, fd

    def take(self) -> bool:
        import fcntl
        import os

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        import os

        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def supervise_node(containers, lease: Lease, lock: NodeLock) -> str:
    """Fence every live container of the node once its lease has run out (see the module's docstring);
    return once the lease is out and none is left. The lock is given up first and the lease read again:
    an agent that renewed it meanwhile either found the lock held (and this supervisor goes on) or free
    (and started another)."""
    import os

    folder = os.path.dirname(str(lease.path))
    signalled: dict[str, float] = {}  # container -> when its SIGTERM went (monotonic)
    while True:
        expired = lease.expired()
        if not expired and os.path.isdir(folder):
            signalled.clear()  # renewed: a later expiry fences afresh
            time.sleep(CHECK_S)
            continue
        try:  # the lease ran out, or the agent's state folder is gone (then end once no container is left)
            live = containers.live()
        except Exception:  # the engine restarts, or answered nonsense: ask again next turn
            time.sleep(CHECK_S)
            continue
        now = time.monotonic()
        for cid in live if expired else ():
            if cid not in signalled:
                _say_fenced(lease, f"container {cid[:12]}")
                mark_fenced(lease.path, cid)
                signalled[cid] = now
                _kill(containers, cid, "SIGTERM")
            elif now - signalled[cid] >= lease.grace_s:
                _kill(containers, cid, "SIGKILL")
        if not live:
            lock.release()
            if lease.expired() or not os.path.isdir(folder) or not lock.take():
                return "fenced" if signalled else "idle"
        # Wake for the next SIGKILL that falls due, else in CHECK_S.
        due = [t + lease.grace_s - time.monotonic() for c, t in signalled.items() if c in live]
        time.sleep(min([CHECK_S, *[d for d in due if d > 0]]))


def _kill(containers, cid: str, signal: str) -> None:
    try:
        containers.kill(cid, signal)
    except OSError:
        pass  # the engine restarts: the next turn signals again


def supervise_domain(name: str, uri: str, lease: Lease) -> str:
    """A kvm sandbox's VM, until it ends or the lease runs out: then the ACPI power button until the
    grace, then destroy (one supervisor per VM; docker's is ``supervise_node``, one per node)."""
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
    ap.add_argument("kind", choices=["docker-node", "kvm"])
    ap.add_argument("sandbox", help="the node's name (docker-node), or the VM's domain name (kvm)")
    ap.add_argument("--installation", default="", help="docker-node: the containers' installation label")
    ap.add_argument("--lock-fd", type=int, default=None, help="docker-node: supervisor.lock, already held")
    ap.add_argument("--uri", default="qemu:///system", help="libvirt's (kvm)")
    ap.add_argument("--lease-file", required=True)
    ap.add_argument("--lease-s", type=float, default=60.0, help="the deadline from now while the file is missing")
    ap.add_argument("--grace-s", type=float, default=3.0, help="SIGTERM grace while the file is missing")
    args = ap.parse_args(argv)
    lease = Lease(args.lease_file, args.lease_s, args.grace_s)
    if args.kind == "docker-node":
        import os

        lock = NodeLock(os.path.join(os.path.dirname(args.lease_file), "supervisor.lock"), args.lock_fd)
        if lock.fd is None and not lock.take():
            return 0  # the node has its supervisor
        engine = engine_socket()
        containers = (SocketContainers(engine, args.sandbox, args.installation) if engine is not None
                      else SdkContainers(args.sandbox, args.installation))
        supervise_node(containers, lease, lock)
    else:
        supervise_domain(args.sandbox, args.uri, lease)
    return 0


if __name__ == "__main__":
    sys.exit(main())
