"""Ways into a docker job's network for the session gateway that need no root (docs/sessions.md).

A container with network none is reached on its own loopback only. A root agent enters its network
namespace (agents/sessions.py NetnsRelay); an agent that is only in the docker group cannot, so it
asks the engine instead: each connection is a ``docker exec`` in the job's container, as the job's
user, of a forwarder from its stdin and stdout to the app's port on 127.0.0.1 (socat, nc or
python3, whichever the image has). The bytes ride the exec's attach stream on the engine's socket:
the container gains no route and nothing on the host listens on its behalf but the relay's own
unix socket in the agent's private folder. A shell is hung up the same way: ``kill -HUP`` run in
the container, as the job's user, when the agent may not signal it from the host.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from agents.sessions import Relay

log = logging.getLogger(__name__)

# The forwarder: $0 is the port. socat and python3 half-close as TCP does; busybox's nc will do.
FORWARD = (
    'if command -v socat >/dev/null 2>&1; then exec socat - "TCP:127.0.0.1:$0"; '
    'elif command -v nc >/dev/null 2>&1; then exec nc 127.0.0.1 "$0"; '
    'elif command -v python3 >/dev/null 2>&1; then exec python3 -c "$1" "$0"; '
    'else echo "the image has neither socat, nc nor python3 to reach the app" >&2; exit 127; fi')
PY_FORWARD = """import socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def up():
    while d := sys.stdin.buffer.read1(65536):
        s.sendall(d)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while d := s.recv(65536):
    sys.stdout.buffer.write(d)
    sys.stdout.buffer.flush()
"""
# How long a probe waits for a forwarder to give up (it exits at once when nothing listens).
PROBE_S = 1.0


class ExecRelay(Relay):
    """The relay's connections carried by ``docker exec`` of a forwarder in the job's container."""

    def __init__(self, client, container_id: str, port: int):
        self.client, self.container_id, self.port = client, container_id, int(port)
        super().__init__()

    def _exec(self):
        api = self.client.api
        exec_id = api.exec_create(self.container_id, ["/bin/sh", "-c", FORWARD, str(self.port), PY_FORWARD],
                                  stdin=True, tty=False)["Id"]
        sock = api.exec_start(exec_id, socket=True)
        return exec_id, getattr(sock, "_sock", sock)

    async def open_upstream(self):
        import docker.errors
        import requests

        try:
            exec_id, sock = await asyncio.to_thread(self._exec)
        except (docker.errors.APIError, requests.RequestException) as exc:
            raise OSError(f"docker exec in the job's container: {exc}") from None
        sock.setblocking(False)
        raw, writer = await asyncio.open_connection(sock=sock)
        return _Demuxed(raw, exec_id), _Closing(writer, self, exec_id)

    async def answers(self) -> bool:
        """A forwarder that finds nothing listening exits at once; one still running has connected."""
        try:
            reader, writer = await self.open_upstream()
        except OSError:
            return False
        try:
            data = await asyncio.wait_for(reader.read(1), PROBE_S)
            return bool(data)  # the app spoke first (a banner): it listens
        except asyncio.TimeoutError:
            return True
        finally:
            writer.close()

    def stop_forwarder(self, exec_id: str) -> None:
        """A forwarder whose connection closed ends too (nc may wait for the app to hang up)."""
        signal_exec(self.client.api, self.container_id, exec_id, signal.SIGTERM)


class _Demuxed:
    """The stdout of an exec without a TTY, whose attach stream frames stdout and stderr (8-byte
    headers: stream, 0, 0, 0, big-endian length); read on demand, so a slow reader slows the app."""

    def __init__(self, raw, exec_id: str):
        self.raw, self.exec_id, self.left = raw, exec_id, 0

    async def read(self, n: int) -> bytes:
        while self.left == 0:
            try:
                head = await self.raw.readexactly(8)
                if head[0] != 1:  # stderr: the forwarder's complaint
                    err = await self.raw.readexactly(int.from_bytes(head[4:8], "big"))
                    log.info("exec %s: %s", self.exec_id[:12], err.decode(errors="replace").strip()[:300])
                    continue
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                return b""
            self.left = int.from_bytes(head[4:8], "big")
        data = await self.raw.read(min(n, self.left))
        self.left -= len(data)
        return data


class _Closing:
    """The attach stream's writer; closing it ends the forwarder as well."""

    def __init__(self, writer, relay: ExecRelay, exec_id: str):
        self._w, self._relay, self._exec_id, self._closed = writer, relay, exec_id, False

    def __getattr__(self, name):
        return getattr(self._w, name)

    def close(self) -> None:
        self._w.close()
        if not self._closed:
            self._closed = True
            asyncio.get_running_loop().run_in_executor(None, self._relay.stop_forwarder, self._exec_id)


def signal_exec(api, container_id: str, exec_id: str, sig: int) -> None:
    """Send ``sig`` to an exec's process if it still runs: from the host where the agent may (root),
    else with ``kill`` run in the container as the job's user (its pid there read from /proc's NSpid)."""
    import docker.errors
    import requests

    try:
        info = api.exec_inspect(exec_id)
        pid = info.get("Pid") if info.get("Running") else 0
        if not pid:
            return
        try:
            os.kill(pid, sig)
            return
        except PermissionError:
            pass
        inner = _pid_inside(pid)
        if inner:
            kill = api.exec_create(container_id, ["/bin/sh", "-c", 'kill -"$0" "$1"', str(int(sig)), str(inner)])["Id"]
            api.exec_start(kill)
    except (docker.errors.APIError, requests.RequestException, OSError) as exc:
        log.debug("exec %s: signal %s: %s", exec_id[:12], sig, exc)


def _pid_inside(host_pid: int) -> int:
    """A process's pid in its own (the container's) pid namespace: the last of NSpid."""
    with open(f"/proc/{host_pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return 0
