"""Interactive sessions on the node: the agent's session gateway (docs/sessions.md).

A job may publish ports (JupyterLab, a terminal, an HTTP app). The app listens where only the
agent can reach it: a unix socket in a folder of the job's own (JupyterLab), the job's loopback
(an HTTP app in the process sandbox), or no listener at all (a terminal: the gateway starts a shell
in the sandbox on a pseudo-terminal). The gateway is one small HTTP server per agent
(``--session-listen``); the portal's proxy, and nothing else, calls it with the session's secret:

    portal  --HTTP/WebSocket, X-Gpuportal-Session-Secret-->  gateway  --unix socket / loopback-->  app

A request without the right secret, or for a session this node does not run, gets 404. The
gateway passes HTTP and WebSocket traffic through unchanged (bodies streamed, compression kept),
adds the secret as JupyterLab's token, and reports each session to the portal once its app answers
(``running``) and when the sandbox goes (``ended``).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hmac
import json
import logging
import os
import pty
import signal
import struct
import termios
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SECRET_HEADER = "X-Gpuportal-Session-Secret"
# Asks for the app's raw bytes over a WebSocket instead of HTTP (gpuctl port-forward; a browser cannot
# set it).
TCP_HEADER = "X-Gpuportal-Tcp"
# Headers that describe one hop, never passed on (RFC 9110 7.6.1), plus what the gateway sets itself.
HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", SECRET_HEADER.lower(),
               "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-accept",
               "sec-websocket-protocol"}
MAX_FRAME_BYTES = 16 * 1024 * 1024
CHUNK = 64 * 1024


def session_env(sessions: list[dict], sockets: dict[str, str]) -> dict[str, str]:
    """What the job is told about its sessions: GPUPORTAL_SESSION_<NAME>_URL (the path the portal
    serves it at), _PORT or _SOCKET (where its app must listen) and _TOKEN (the secret the gateway
    sends; an HTTP app may check it)."""
    env = {}
    for s in sessions:
        key = "GPUPORTAL_SESSION_" + s["name"].upper().replace("-", "_")
        env[key + "_URL"] = s["base_url"]
        env[key + "_TOKEN"] = s["secret"]
        if s["name"] in sockets:
            env[key + "_SOCKET"] = sockets[s["name"]]
        if s.get("port"):
            env[key + "_PORT"] = str(s["port"])
    return env


def jupyter_config(session: dict, socket_path: str) -> dict:
    """jupyter_server settings for a jupyter session: serve under the portal's path, on the unix
    socket only, with the session's secret as the token (a connection without it is refused)."""
    return {
        "ServerApp": {"sock": socket_path, "sock_mode": "0600", "base_url": session["base_url"],
                      "open_browser": False, "allow_remote_access": True, "quit_button": False,
                      "allow_root": True},  # CI and the development machines run the agent as root
        "IdentityProvider": {"token": session["secret"]},
    }


@dataclass
class Published:
    """One job's sessions on this node, as the gateway serves them."""

    job_id: str
    attempt: int
    sessions: dict[str, dict]  # name -> {name, kind, port, secret, base_url}
    targets: dict[str, tuple]  # name -> ("unix", path) | ("tcp", host, port)
    shell: tuple | None = None  # (argv, env, cwd) for terminal sessions
    reported: set[str] = field(default_factory=set)
    relays: dict = field(default_factory=dict)  # name -> Relay: closed when the job is withdrawn
    problems: dict = field(default_factory=dict)  # name -> why the gateway cannot reach its app


class Gateway:
    """The agent's session gateway: an aiohttp server on its own thread and event loop."""

    def __init__(self, *, listen: str = "127.0.0.1:0", public_url: str = "", client=None,
                 max_frame_bytes: int = MAX_FRAME_BYTES, ready_timeout_s: float = 300.0):
        host, _, port = listen.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port or 0)
        self.public_url = public_url.rstrip("/")
        self.client = client  # agents.client.PortalClient: session reports
        self.max_frame_bytes = max_frame_bytes
        self.ready_timeout_s = ready_timeout_s
        self._published: dict[str, Published] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._runner = None

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    # -- life -------------------------------------------------------------------

    def start(self) -> "Gateway":
        self._thread = threading.Thread(target=self._run, name="session-gateway", daemon=True)
        self._thread.start()
        if not self._started.wait(15):
            raise RuntimeError("the session gateway did not start")
        if self._error:
            raise self._error
        log.info("session gateway listening on %s:%s (the portal reaches it as %s)", self.host, self.port, self.url)
        return self

    _error: Exception | None = None

    def _run(self) -> None:
        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1024 ** 3)
        app.router.add_route("*", "/sessions/{job}/{name}/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except Exception as exc:  # a taken port: said at start, not later
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        with self._lock:
            published = list(self._published.values())
        for pub in published:  # their sandboxes may outlive the agent; the relays' folders do not
            self._close_relays(pub)
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # -- what runs here ----------------------------------------------------------

    def publish(self, job_id: str, attempt: int, sessions: list[dict], targets: dict[str, tuple],
                shell: tuple | None = None) -> None:
        """Serve a job's sessions. A target is ("unix", path), ("tcp", host, port), ("netns",
        "/proc/<pid>/ns/net", port): a port on the loopback of a sandbox with a network namespace of its
        own (a docker container with network none), reached through a relay (NetnsRelay), or ("relay",
        a Relay not yet started) for one the driver makes (the docker sandbox's ExecRelay)."""
        pub = Published(str(job_id), int(attempt), {s["name"]: s for s in sessions}, dict(targets), shell)
        for name, target in list(pub.targets.items()):
            if target[0] in ("netns", "relay"):
                relay = None
                try:
                    if self._loop is None:
                        raise RuntimeError("the gateway is not started")
                    relay = NetnsRelay(target[1], int(target[2])) if target[0] == "netns" else target[1]
                    asyncio.run_coroutine_threadsafe(relay.start(), self._loop).result(15)
                except (OSError, RuntimeError) as exc:
                    log.warning("job %s session %s: no way into the sandbox's network: %s", job_id, name, exc)
                    if relay is not None:
                        relay.cleanup()
                    pub.targets.pop(name)
                    pub.problems[name] = f"the gateway cannot reach the app: {exc}"
                    continue
                pub.relays[name] = relay
                pub.targets[name] = ("unix", relay.path)
        with self._lock:
            old = self._published.get(pub.job_id)
            self._published[pub.job_id] = pub
        if old is not None:
            self._close_relays(old)
        if self._loop is not None:
            for name in pub.sessions:
                asyncio.run_coroutine_threadsafe(self._await_ready(pub, name), self._loop)

    def withdraw(self, job_id: str) -> None:
        with self._lock:
            pub = self._published.pop(str(job_id), None)
        if pub is not None:
            self._close_relays(pub)
            for name in pub.sessions:
                self._report(pub, name, "ended")

    def _close_relays(self, pub: Published) -> None:
        for relay in pub.relays.values():
            if self._loop is not None and self._loop.is_running():
                try:
                    asyncio.run_coroutine_threadsafe(relay.close(), self._loop).result(10)
                    continue
                except Exception as exc:  # the loop is stopping: the folder still goes
                    log.debug("relay %s: %s", relay.path, exc)
            relay.cleanup()

    def _lookup(self, job_id: str, name: str, secret: str) -> tuple[Published, dict] | None:
        with self._lock:
            pub = self._published.get(job_id)
        session = pub.sessions.get(name) if pub else None
        if session is None or not hmac.compare_digest(secret.encode(), session["secret"].encode()):
            return None
        return pub, session

    async def _await_ready(self, pub: Published, name: str) -> None:
        """Report ``running`` once the app answers (a terminal at once)."""
        kind = pub.sessions[name]["kind"]
        if name in pub.problems:
            await asyncio.to_thread(self._report, pub, name, "starting", pub.problems[name])
            return
        deadline = asyncio.get_running_loop().time() + self.ready_timeout_s
        while kind != "terminal":
            with self._lock:
                if self._published.get(pub.job_id) is not pub:
                    return
            relay = pub.relays.get(name)
            if await (self._relay_answers(relay) if relay else self._answers(pub.targets.get(name))):
                break
            if asyncio.get_running_loop().time() > deadline:
                await asyncio.to_thread(self._report, pub, name, "starting",
                                        f"the app did not listen within {self.ready_timeout_s:.0f} s")
                return
            await asyncio.sleep(0.25)
        await asyncio.to_thread(self._report, pub, name, "running")

    @staticmethod
    async def _relay_answers(relay) -> bool:
        """Whether the app listens behind a relay (the relay's own socket always does)."""
        return await relay.answers()

    @staticmethod
    async def _answers(target) -> bool:
        if target is None:
            return False
        try:
            if target[0] == "unix":
                _, writer = await asyncio.open_unix_connection(target[1])
            else:
                _, writer = await asyncio.open_connection(target[1], target[2])
        except OSError:
            return False
        writer.close()
        return True

    def _report(self, pub: Published, name: str, state: str, message: str = "") -> None:
        if self.client is None:
            return
        try:
            self.client._post(f"/jobs/{pub.job_id}/sessions", {
                "attempt": pub.attempt, "name": name, "state": state,
                "gateway_url": self.url if state == "running" else "", "message": message})
        except Exception as exc:  # the portal catches up from the job's own state
            log.warning("job %s session %s: could not report %s: %s", pub.job_id, name, state, exc)

    # -- requests from the portal -------------------------------------------------

    async def _handle(self, request):
        from aiohttp import web

        found = self._lookup(request.match_info["job"], request.match_info["name"],
                             request.headers.get(SECRET_HEADER, ""))
        if found is None:
            return web.Response(status=404, text="no such session\n")
        pub, session = found
        is_ws = request.headers.get("Upgrade", "").lower() == "websocket"
        if session["kind"] == "terminal":
            if not is_ws or pub.shell is None:
                return web.Response(status=404, text="a terminal session speaks WebSocket only\n")
            return await self._terminal(request, pub.shell)
        target = pub.targets.get(session["name"])
        if target is None:
            return web.Response(status=502, text="the session's app has no address\n")
        if is_ws and request.headers.get(TCP_HEADER) == "1":  # gpuctl port-forward: the app's bytes as they are
            return await self._relay_tcp(request, target)
        path = request.raw_path
        if session["kind"] == "http":  # an HTTP app is served at its own root
            prefix = session["base_url"].rstrip("/")
            path = path[len(prefix):] if path.startswith(prefix) else path
            path = path if path.startswith("/") else "/" + path
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        headers["Host"] = request.headers.get("Host", "localhost")
        if session["kind"] == "jupyter":
            headers["Authorization"] = f"token {session['secret']}"
        headers["X-Forwarded-Prefix"] = session["base_url"].rstrip("/")
        if is_ws:
            return await self._relay_ws(request, target, path, headers)
        return await self._relay_http(request, target, path, headers)

    def _client(self, target):
        import aiohttp

        if target[0] == "unix":
            connector = aiohttp.UnixConnector(path=target[1])
            base = "http://localhost"
        else:
            connector = aiohttp.TCPConnector()
            base = f"http://{target[1]}:{target[2]}"
        return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)), base

    async def _relay_http(self, request, target, path, headers):
        import aiohttp
        from aiohttp import web

        session, base = self._client(target)
        async with session:
            body = request.content if request.body_exists else None
            try:
                async with session.request(request.method, base + path, headers=headers, data=body,
                                           allow_redirects=False) as up:
                    resp = web.StreamResponse(status=up.status, reason=up.reason)
                    for k, v in up.headers.items():
                        if k.lower() not in HOP_HEADERS:
                            resp.headers.add(k, v)
                    if up.headers.get("Content-Length") is not None:
                        resp.content_length = int(up.headers["Content-Length"])
                    await resp.prepare(request)
                    async for chunk in up.content.iter_chunked(CHUNK):
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
            except (aiohttp.ClientConnectionError, OSError) as exc:
                return web.Response(status=502, text=f"the session's app does not answer: {exc}\n")

    async def _relay_ws(self, request, target, path, headers):
        import aiohttp
        from aiohttp import web

        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        session, base = self._client(target)
        async with session:
            try:
                up = await session.ws_connect(base + path, headers=headers, protocols=protocols,
                                              max_msg_size=self.max_frame_bytes, autoping=True)
            except (aiohttp.ClientError, OSError) as exc:
                log.warning("job %s session %s: the app refused a WebSocket to %s: %s", request.match_info["job"],
                            request.match_info["name"], path, exc)
                return web.Response(status=502, text=f"the session's app refused the WebSocket: {exc}\n")
            down = web.WebSocketResponse(protocols=[up.protocol] if up.protocol else (),
                                         max_msg_size=self.max_frame_bytes)
            await down.prepare(request)
            await _pump_ws(down, up)
            return down

    async def _relay_tcp(self, request, target):
        """One TCP connection to the app, carried in binary WebSocket messages (gpuctl port-forward)."""
        from aiohttp import WSMsgType, web

        try:
            if target[0] == "unix":
                reader, writer = await asyncio.open_unix_connection(target[1])
            else:
                reader, writer = await asyncio.open_connection(target[1], target[2])
        except OSError as exc:
            return web.Response(status=502, text=f"the session's app does not answer: {exc}\n")
        ws = web.WebSocketResponse(max_msg_size=self.max_frame_bytes)
        await ws.prepare(request)

        async def to_client():
            while data := await reader.read(CHUNK):
                await ws.send_bytes(data)
            await ws.close()

        pump = asyncio.create_task(to_client())
        try:
            async for msg in ws:
                if msg.type == WSMsgType.BINARY:
                    writer.write(msg.data)
                    await writer.drain()
        finally:
            pump.cancel()
            writer.close()
        return ws

    async def _terminal(self, request, shell):
        """A shell in the sandbox on a pseudo-terminal. Binary frames carry output; text frames are
        JSON: {"type": "input", "data": "..."} or {"type": "resize", "cols": N, "rows": N}.

        ``shell`` is the driver's: (argv, env, cwd) for a shell the gateway starts itself (the process
        sandbox), or an object whose ``spawn()`` gives a terminal (the docker sandbox's ``docker exec``)."""
        from aiohttp import WSMsgType, web

        ws = web.WebSocketResponse(max_msg_size=self.max_frame_bytes)
        await ws.prepare(request)
        try:
            term = await asyncio.to_thread(shell.spawn) if hasattr(shell, "spawn") else PtyTerminal(*shell)
        except Exception as exc:  # the sandbox went, or its engine refused
            log.warning("job %s: could not start a terminal: %s", request.match_info["job"], exc)
            await ws.send_bytes(f"could not start a shell in the job: {exc}\r\n".encode())
            await ws.close()
            return ws
        fd = term.fd
        loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        out: asyncio.Queue = asyncio.Queue()

        def readable():
            try:
                data = os.read(fd, CHUNK)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                data = b""  # EIO: the shell ended (a pty), or the attach broke
            out.put_nowait(data)
            if not data:
                loop.remove_reader(fd)

        loop.add_reader(fd, readable)

        async def to_browser():
            while True:
                data = await out.get()
                if not data:
                    await ws.close()
                    return
                await ws.send_bytes(data)

        sender = asyncio.create_task(to_browser())
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    try:
                        m = json.loads(msg.data)
                    except ValueError:
                        continue
                    if m.get("type") == "input" and isinstance(m.get("data"), str):
                        await _write_all(fd, m["data"].encode())
                    elif m.get("type") == "resize":
                        cols, rows = int(m.get("cols") or 80), int(m.get("rows") or 24)
                        await asyncio.to_thread(term.resize, cols, rows)
                elif msg.type == WSMsgType.BINARY:
                    await _write_all(fd, msg.data)
        finally:
            sender.cancel()
            loop.remove_reader(fd)
            await asyncio.to_thread(term.close)
        return ws


CLONE_NEWNET = 0x40000000


class Relay:
    """A unix socket on the host, in a private (0700) folder only the agent reaches, whose every
    connection is carried to the app's TCP port inside a sandbox that has no route from the host.
    A subclass says how it opens the way in (``open_upstream``)."""

    def __init__(self):
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="gpr-")  # 0700: only the agent connects
        self.path = os.path.join(self.folder, "relay.sock")
        self.server = None
        self.carrying: set = set()  # the connections' tasks, ended with the relay

    async def open_upstream(self):
        """(reader, writer) of one connection to the app; OSError when there is no way in."""
        raise NotImplementedError

    async def answers(self) -> bool:
        """Whether the app accepts a connection now."""
        try:
            _, writer = await self.open_upstream()
        except OSError:
            return False
        writer.close()
        return True

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._carry, self.path)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.carrying):
            task.cancel()
        await asyncio.gather(*self.carrying, return_exceptions=True)
        self.cleanup()

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)

    async def _carry(self, reader, writer) -> None:
        task = asyncio.current_task()
        self.carrying.add(task)
        try:
            await self._carry_one(reader, writer)
        finally:
            self.carrying.discard(task)

    async def _carry_one(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await self.open_upstream()
        except OSError:
            writer.close()
            return

        async def pump(src, dst):
            try:
                while data := await src.read(CHUNK):
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()
            except (ConnectionError, OSError):
                dst.close()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True)
        finally:  # also when the relay closes under a connection
            for w in (writer, up_writer):
                w.close()


class NetnsRelay(Relay):
    """Carried to a TCP port on the loopback of another network namespace (a container's with network
    none), entered with setns. The namespace is held open from the start, so a pid reused after the
    container ends can never lead elsewhere. Entering it takes CAP_SYS_ADMIN: a root agent's way (a
    non-root one uses the docker sandbox's ExecRelay)."""

    def __init__(self, ns_path: str, port: int):
        self.port = port
        self.ns_fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
        super().__init__()

    def cleanup(self) -> None:
        super().cleanup()
        if self.ns_fd >= 0:
            os.close(self.ns_fd)
            self.ns_fd = -1

    async def open_upstream(self):
        sock = await asyncio.to_thread(self.connect)
        return await asyncio.open_connection(sock=sock)

    def connect(self):
        """A TCP socket connected to the port inside the namespace: made by a thread that enters the
        namespace and ends there (a socket keeps the namespace it was made in)."""
        import ctypes
        import socket

        box: dict = {}

        def run():
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(self.ns_fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"entering the sandbox's network: {os.strerror(err)}")
                sock = socket.socket()
                sock.settimeout(10)
                sock.connect(("127.0.0.1", self.port))
                sock.setblocking(False)
                box["sock"] = sock
            except OSError as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, name="netns-connect", daemon=True)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["sock"]


async def _write_all(fd: int, data: bytes) -> None:
    """Write to a non-blocking terminal, waiting while it is full (a large paste)."""
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            await asyncio.sleep(0.01)


class PtyTerminal:
    """A shell the gateway starts itself on a pseudo-terminal (the process sandbox)."""

    def __init__(self, argv: list[str], env: dict, cwd: str):
        pid, fd = pty.fork()
        if pid == 0:  # the child: become the shell
            try:
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd

    def resize(self, cols: int, rows: int) -> None:
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def close(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGHUP)
        except OSError:
            pass
        os.close(self.fd)
        _reap(self.pid)


def _reap(pid: int) -> None:
    import time

    for _ in range(50):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


async def _pump_ws(a, b) -> None:
    """Relay messages between two aiohttp WebSockets (server or client side) until either closes."""
    from aiohttp import WSMsgType

    async def one_way(src, dst):
        async for msg in src:
            if msg.type == WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            else:
                break
        await dst.close()

    tasks = [asyncio.create_task(one_way(a, b)), asyncio.create_task(one_way(b, a))]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await a.close()
    await b.close()


class SessionDriver:
    """Wraps a sandbox driver: a job launched with sessions is published on the gateway, and
    withdrawn when its sandbox is removed. Everything else goes to the driver unchanged."""

    def __init__(self, driver, gateway: Gateway):
        self._driver = driver
        self.gateway = gateway

    def __getattr__(self, name):
        return getattr(self._driver, name)

    def __setattr__(self, name, value):  # the agent sets lease_s and the like on its driver
        if name in ("_driver", "gateway"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._driver, name, value)

    def launch(self, spec):
        handle = self._driver.launch(spec)
        if spec.sessions:
            self._publish(spec.sessions, handle)
        return handle

    def _publish(self, sessions, handle) -> None:
        if not hasattr(self._driver, "session_targets"):  # kvm: none (docs/sessions.md)
            pub = Published(handle.job_id, handle.attempt, {s["name"]: s for s in sessions}, {})
            for s in sessions:
                self.gateway._report(pub, s["name"], "starting",
                                     f"the {self._driver.name} sandbox cannot publish sessions")
            return
        targets = self._driver.session_targets(handle, sessions)
        shell = self._driver.session_shell(handle) if any(s["kind"] == "terminal" for s in sessions) else None
        self.gateway.publish(handle.job_id, handle.attempt, sessions, targets, shell)

    def list_own(self):
        own = self._driver.list_own()
        for _, _, handle in own:  # a restarted agent serves the sessions of the sandboxes it adopts
            sessions = getattr(self._driver, "session_specs", lambda h: [])(handle)
            if sessions:
                self._publish(sessions, handle)
        return own

    def remove(self, handle):
        self.gateway.withdraw(handle.job_id)
        return self._driver.remove(handle)
