"""Stand-ins for the node's own services, and a job that tries to reach them: the egress tests of every
sandbox share them (tests/agents/test_kvm_boot.py, test_docker_driver.py). Nothing here sends a packet off
the node: every target is one of its own addresses."""

import socket
import threading

import pytest


def node_address() -> str:
    """The node's own address towards the internet (what a public IP of a real node is)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("203.0.113.1", 9))  # UDP connect sends nothing: it only picks the source address
        return probe.getsockname()[0]
    finally:
        probe.close()


@pytest.fixture
def node_services():
    """TCP servers standing for the node's own services: on IPv4 loopback (as PostgreSQL and Redis
    listen), on the node's own address and on IPv6 loopback. Each answers "secret-<port>" to whoever
    connects. Yields the node's address and the three ports."""
    node_ip = node_address()
    servers, stop = [], threading.Event()
    for addr in ("127.0.0.1", node_ip, "::1"):
        srv = socket.create_server((addr, 0), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
        srv.settimeout(0.2)
        servers.append(srv)

    def serve(srv):
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(f"secret-{srv.getsockname()[1]}\n".encode())

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield node_ip, [s.getsockname()[1] for s in servers]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        for s in servers:
            s.close()


def probe_command(targets):
    """The job: try each host:port from inside the guest and print what answered (or nothing). A refused
    connection hangs in QEMU's user-mode network (it sends the guest no reset): 5 s each."""
    return ["sh", "-c", "; ".join(f'echo "{h}:{p}=$( (timeout 5 nc {h} {p} </dev/null) 2>/dev/null)"'
                                  for h, p in targets)]


def probe_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "=" in line]  # the shell adds "Terminated" for a timeout
