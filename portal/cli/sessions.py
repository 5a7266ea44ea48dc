"""gpuctl shell and gpuctl port-forward: a job's published sessions from the terminal (docs/sessions.md).

Both go through the portal's session proxy with the user's token (the submit scope), never to
the node: `shell` speaks the web terminal's WebSocket protocol (output in binary messages, keys and
sizes as JSON), `port-forward` carries each local TCP connection in binary WebSocket messages to a
published port.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading


class SessionError(Exception):
    """Said to the user, exit code 1."""


def find_session(client, job_id: int, *, kind: str | None = None, port: int | None = None,
                 name: str | None = None) -> dict:
    sessions = client.get("sessions/", what=f"job {job_id}", job=job_id).get("results", [])
    for s in sessions:
        if (name and s["name"] == name) or (not name and ((kind and s["kind"] == kind) or
                                                           (port is not None and s["port"] == port))):
            if s["state"] not in ("running", "idle"):
                raise SessionError(f"Session {s['name']} of job {job_id} is {s['state']}"
                                   + (f": {s['message']}" if s.get("message") else "."))
            return s
    if kind == "terminal":
        raise SessionError(f"Job {job_id} publishes no terminal; submit it with ports: [{{name: sh, kind: terminal}}].")
    raise SessionError(f"Job {job_id} publishes no port {port if port is not None else name}; its sessions: "
                       + (", ".join(f"{s['name']} ({s['kind']}{', port ' + str(s['port']) if s['port'] else ''})"
                                    for s in sessions) or "none") + ".")


def ws_url(base_url: str, path: str) -> str:
    return ("wss://" + base_url[len("https://"):] if base_url.startswith("https://")
            else "ws://" + base_url[len("http://"):]) + path


def _connect(url: str, token: str, extra: dict | None = None):
    # websockets (asyncio and all) is a start-up cost: loaded by shell and port-forward alone.
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    try:
        return connect(url, additional_headers={"Authorization": f"Bearer {token}", **(extra or {})},
                       open_timeout=20, max_size=16 * 1024 * 1024, compression=None)
    except InvalidStatus as exc:
        status = exc.response.status_code
        raise SessionError({404: "No such session (or not yours).", 503: "The session is not running."}.get(
            status, f"The portal refused the connection (HTTP {status}).")) from None
    except OSError as exc:
        raise SessionError(f"Cannot reach the portal: {exc}") from None


def shell(base_url: str, token: str, session: dict) -> int:
    """An interactive shell on this terminal until the remote shell exits or the user's input ends."""
    ws = _connect(ws_url(base_url, session["url"] + "ws"), token)
    interactive = sys.stdin.isatty()
    saved = None
    if interactive:
        # POSIX only, and only a terminal shell needs them: not loaded by every gpuctl command.
        import termios
        import tty

        saved = termios.tcgetattr(sys.stdin.fileno())
        tty.setraw(sys.stdin.fileno())
    size = shutil.get_terminal_size()
    ws.send(json.dumps({"type": "resize", "cols": size.columns, "rows": size.lines}))

    def keys():
        try:
            while data := os.read(sys.stdin.fileno(), 4096):
                ws.send(json.dumps({"type": "input", "data": data.decode("utf-8", "replace")}))
            if not interactive:
                ws.send(json.dumps({"type": "input", "data": "\x04"}))  # end of input: end the shell
        except Exception:  # the connection closed under us
            pass

    threading.Thread(target=keys, daemon=True).start()
    try:
        for message in ws:
            data = message if isinstance(message, bytes) else message.encode()
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
    except Exception:  # closed by the other end
        pass
    finally:
        if saved is not None:
            import termios  # as above: POSIX only, loaded by a terminal shell alone

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
        ws.close()
    return 0


def port_forward(base_url: str, token: str, session: dict, local_port: int, *, ready=None,
                 stop: threading.Event | None = None) -> None:
    """Listen on 127.0.0.1:local_port; each connection becomes a WebSocket carrying its bytes."""
    url = ws_url(base_url, session["url"])
    listener = socket.create_server(("127.0.0.1", local_port))
    listener.settimeout(0.5)
    if ready is not None:
        ready(listener.getsockname()[1])
    stop = stop or threading.Event()
    try:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_carry, args=(conn, url, token), daemon=True).start()
    finally:
        listener.close()


def _carry(conn: socket.socket, url: str, token: str) -> None:
    try:
        ws = _connect(url, token, {"X-Gpuportal-Tcp": "1"})
    except SessionError as exc:
        print(f"gpuctl port-forward: {exc}", file=sys.stderr)
        conn.close()
        return

    def up():
        try:
            while data := conn.recv(65536):
                ws.send(data)
        except OSError:
            pass
        ws.close()

    threading.Thread(target=up, daemon=True).start()
    try:
        for message in ws:
            conn.sendall(message if isinstance(message, bytes) else message.encode())
    except Exception:
        pass
    finally:
        conn.close()
