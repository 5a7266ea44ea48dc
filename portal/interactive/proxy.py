"""The session proxy (docs/sessions.md): /sessions/<job id>/<name>/... over HTTP and WebSockets.

A plain ASGI application, served by uvicorn beside the WSGI portal (portal/asgi.py). Every request
and every WebSocket is authenticated again (the portal's session cookie, or a gpp_ token with the
submit scope), the session loaded through the tenant rules (portal/interactive/selectors.py) and
then passed to the agent's gateway on the job's node with the session's secret. Anyone the rules
do not let in gets 404, as everywhere in the portal.

The portal's own cookies never reach the app, and the app may not set them; a WebSocket from
another site (its Origin is not this host) is refused.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.cookies import SimpleCookie
from importlib import import_module
from urllib.parse import urlsplit

import aiohttp
from django.conf import settings
from django.contrib.auth import get_user
from django.db import close_old_connections, connections
from django.template.loader import render_to_string
from django.utils import timezone

from portal.accounts.services import token_authenticate
from portal.core.csp import policy_header

from .selectors import display_state, session_for_connect
from .services import session_touch

log = logging.getLogger(__name__)

SECRET_HEADER = b"x-gpuportal-session-secret"
HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
       b"transfer-encoding", b"upgrade", b"host", b"content-length", SECRET_HEADER, b"sec-websocket-key",
       b"sec-websocket-version", b"sec-websocket-extensions", b"sec-websocket-accept", b"sec-websocket-protocol",
       b"authorization"}
CHUNK = 64 * 1024

# Open proxied connections per user in this process (SESSION_MAX_CONNECTIONS_PER_USER).
_open: dict[int, int] = {}
# When each session's activity was last written (services.session_touch keeps it to one write per 30 s).
_touched: dict[int, object] = {}


# The database work of the proxy (who is asking, which session, its activity) runs on these threads,
# each with its own persistent connection, which `close` closes at shutdown.
DB_THREADS = 4
_db = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="session-proxy-db")


async def _in_db(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_db, functools.partial(fn, *args))


async def close() -> None:
    """At shutdown: the client to the gateways and every database thread's connection."""
    global _client_session
    if _client_session is not None and not _client_session.closed:
        await _client_session.close()
    _client_session = None
    barrier = threading.Barrier(DB_THREADS)

    def close_here():
        try:
            barrier.wait(5)  # one task per thread: each closes its own connection
        except threading.BrokenBarrierError:
            pass
        connections.close_all()

    await asyncio.gather(*(_in_db(close_here) for _ in range(DB_THREADS)))


class Denied(Exception):
    def __init__(self, status: int, text: str):
        self.status, self.text = status, text


def _headers(scope) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for k, v in scope.get("headers") or ():
        k = k.lower()
        out[k] = out[k] + b", " + v if k in out and k != b"cookie" else (out[k] + b"; " + v if k in out else v)
    return out


def _portal_cookies() -> set[str]:
    return {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME, "messages"}


def _strip_cookies(raw: str) -> str:
    """The Cookie header without the portal's own cookies (the app must never see the login)."""
    keep = []
    names = _portal_cookies()
    for part in raw.split(";"):
        name = part.split("=", 1)[0].strip()
        if name and name not in names:
            keep.append(part.strip())
    return "; ".join(keep)


def _set_cookie_allowed(value: str, prefix: str) -> bool:
    """An app may set its own cookies under its own path only: never the portal's, never for "/"."""
    name = value.split("=", 1)[0].strip()
    if name in _portal_cookies() or name.startswith(("__Host-", "__Secure-")):
        return False
    path = "/"
    for attr in value.split(";")[1:]:
        k, _, v = attr.strip().partition("=")
        if k.lower() == "path":
            path = v.strip() or "/"
        if k.lower() == "domain":
            return False
    return (path.rstrip("/") + "/").startswith(prefix.rstrip("/") + "/")


def _authenticate(headers: dict[bytes, bytes]):
    """(user, token) from a Bearer token or the portal's session cookie; (None, None) if neither."""
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        token = token_authenticate(auth.split(None, 1)[1].strip())
        return (token.user, token) if token is not None else (None, None)
    cookie = SimpleCookie()
    try:
        cookie.load(headers.get(b"cookie", b"").decode("latin-1"))
    except Exception:
        return None, None
    morsel = cookie.get(settings.SESSION_COOKIE_NAME)
    if morsel is None or not morsel.value:
        return None, None
    store = import_module(settings.SESSION_ENGINE).SessionStore(morsel.value)

    class _Request:  # what django.contrib.auth.get_user reads
        session = store

    user = get_user(_Request())
    return (user, None) if user.is_authenticated else (None, None)


def _load(headers, job_id: str, name: str):
    """The session to proxy and its gateway, checked for this request. Raises Denied."""
    close_old_connections()
    user, token = _authenticate(headers)
    session = session_for_connect(user, job_id, name, token=token)
    if session is None:
        raise Denied(404, "Not found.")
    state = display_state(session)
    # A node that ran an earlier attempt is never sent this attempt's key: until the new attempt's node
    # reports, the session is not running.
    current = session.gateway_attempt == session.job.attempt
    return {"id": session.pk, "user": user.pk, "kind": session.kind,
            "secret": session.secret_for(session.job.attempt),
            "gateway": session.gateway_url if current else "", "state": state, "prefix": session.path,
            "name": session.name,
            "job": session.job_id, "message": session.message}


def _touch(session_id: int) -> None:
    close_old_connections()
    if session_touch(session_id, _touched.get(session_id)):
        _touched[session_id] = timezone.now()


def _terminal_page(info: dict) -> bytes:
    return render_to_string("interactive/terminal.html", {"session": info}).encode()


def _starting_page(info: dict) -> bytes:
    return render_to_string("interactive/starting.html", {"session": info}).encode()


async def app(scope, receive, send):
    """The whole ASGI entry point for /sessions/ (portal/asgi.py routes here)."""
    kind = scope["type"]
    parts = scope["path"].split("/", 4)  # "", "sessions", job, name, rest
    if len(parts) < 4 or not parts[2] or not parts[3]:
        return await _refuse(scope, receive, send, 404, "Not found.")
    if len(parts) == 4:  # /sessions/<job>/<name>: the app's root has a trailing slash
        if kind == "http":
            return await _respond(send, 302, b"", extra=[(b"location", scope["path"].encode() + b"/")])
        return await _refuse(scope, receive, send, 404, "Not found.")
    headers = _headers(scope)
    try:
        info = await _in_db(_load, headers, parts[2], parts[3])
    except Denied as exc:
        return await _refuse(scope, receive, send, exc.status, exc.text)
    if kind == "websocket":
        origin = headers.get(b"origin")
        if origin and urlsplit(origin.decode("latin-1")).netloc.lower() != headers.get(b"host", b"").decode(
                "latin-1").lower():
            return await _refuse(scope, receive, send, 403, "Cross-site WebSocket refused.")
    user = info["user"]
    if _open.get(user, 0) >= settings.SESSION_MAX_CONNECTIONS_PER_USER:
        return await _refuse(scope, receive, send, 429, "Too many open session connections.")
    _open[user] = _open.get(user, 0) + 1
    try:
        await _in_db(_touch, info["id"])
        if info["kind"] == "terminal" and kind == "http":
            if parts[4] == "":
                page = await _in_db(_terminal_page, info)
                return await _respond(send, 200, page, content_type=b"text/html; charset=utf-8", csp=True)
            return await _respond(send, 404, b"Not found.\n")
        if info["state"] not in ("running", "idle") or not info["gateway"]:
            if kind == "http":
                page = await _in_db(_starting_page, info)
                return await _respond(send, 503, page, content_type=b"text/html; charset=utf-8", csp=True,
                                      extra=[(b"retry-after", b"2")])
            return await _refuse(scope, receive, send, 503, "The session is not running.")
        if kind == "http":
            return await _proxy_http(scope, receive, send, headers, info)
        return await _proxy_ws(scope, receive, send, headers, info)
    finally:
        _open[user] -= 1
        if not _open[user]:
            del _open[user]


async def _respond(send, status: int, body: bytes, *, content_type=b"text/plain; charset=utf-8", csp=False,
                   extra=()):
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
               (b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff")]
    if csp:  # the portal's own pages' policy
        headers.append((b"content-security-policy", policy_header(settings.CONTENT_SECURITY_POLICY).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers + list(extra)})
    await send({"type": "http.response.body", "body": body})


async def _refuse(scope, receive, send, status: int, text: str):
    if scope["type"] == "http":
        return await _respond(send, status, (text + "\n").encode())
    # A WebSocket handshake answered with a real HTTP status where the server can (uvicorn can).
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body = (text + "\n").encode()
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": 4000 + status})


def _upstream_headers(headers: dict[bytes, bytes], info: dict) -> dict[str, str]:
    out = {}
    for k, v in headers.items():
        if k in HOP:
            continue
        if k == b"cookie":
            stripped = _strip_cookies(v.decode("latin-1"))
            if stripped:
                out["Cookie"] = stripped
            continue
        out[k.decode("latin-1")] = v.decode("latin-1")
    out["Host"] = headers.get(b"host", b"localhost").decode("latin-1")
    out["X-Gpuportal-Session-Secret"] = info["secret"]
    return out


def _url(info: dict, scope) -> str:
    path = scope.get("raw_path") or scope["path"].encode()
    url = info["gateway"].rstrip("/") + path.decode("latin-1")
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    return url


_client_session = None


def _client():
    """One aiohttp client per process and event loop: keep-alive connections to the gateways."""
    global _client_session
    loop = asyncio.get_running_loop()
    if _client_session is None or _client_session._loop is not loop or _client_session.closed:
        _client_session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0))
    return _client_session


async def _body(receive):
    """The request body as an async stream (uploads are not held in memory)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body"):
            return


async def _proxy_http(scope, receive, send, headers, info):
    method = scope["method"]
    has_body = method not in ("GET", "HEAD", "OPTIONS") or b"content-length" in headers \
        or b"transfer-encoding" in headers
    try:
        async with _client().request(method, _url(info, scope), headers=_upstream_headers(headers, info),
                                     data=_body(receive) if has_body else None, allow_redirects=False) as up:
            out = []
            for k, v in up.raw_headers:
                lk = k.lower()
                if lk in HOP and lk != b"content-length":
                    continue
                if lk == b"set-cookie" and not _set_cookie_allowed(v.decode("latin-1"), info["prefix"]):
                    continue
                out.append((lk, v))
            await send({"type": "http.response.start", "status": up.status, "headers": out})
            async for chunk in up.content.iter_chunked(CHUNK):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        log.info("session %s/%s: gateway unreachable: %s", info["job"], info["name"], exc)
        await _respond(send, 502, b"The session's node does not answer.\n")


async def _proxy_ws(scope, receive, send, headers, info):
    first = await receive()
    if first["type"] != "websocket.connect":
        return
    protocols = scope.get("subprotocols") or []
    try:
        up = await _client().ws_connect(_url(info, scope), headers=_upstream_headers(headers, info),
                                        protocols=protocols, max_msg_size=settings.SESSION_MAX_FRAME_BYTES,
                                        autoping=True)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return await _refuse(scope, receive, send, 502, "The session's app refused the WebSocket.")
    accept = {"type": "websocket.accept"}
    if up.protocol:
        accept["subprotocol"] = up.protocol
    await send(accept)
    last_touch = time.monotonic()

    async def from_browser():
        nonlocal last_touch
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("bytes") if msg.get("bytes") is not None else msg.get("text")
            if data is None:
                continue
            if len(data) > settings.SESSION_MAX_FRAME_BYTES:
                await send({"type": "websocket.close", "code": 1009})
                return
            if isinstance(data, bytes):
                await up.send_bytes(data)
            else:
                await up.send_str(data)
            if time.monotonic() - last_touch > 30:  # keystrokes and kernel messages keep a session alive
                last_touch = time.monotonic()
                await _in_db(_touch, info["id"])

    async def to_browser():
        nonlocal last_touch
        async for msg in up:
            if time.monotonic() - last_touch > 30:  # kernel output counts too (a long cell is not idle)
                last_touch = time.monotonic()
                await _in_db(_touch, info["id"])
            if msg.type == aiohttp.WSMsgType.TEXT:
                await send({"type": "websocket.send", "text": msg.data})
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await send({"type": "websocket.send", "bytes": msg.data})
            else:
                break
        try:
            await send({"type": "websocket.close", "code": 1000})
        except Exception:
            pass

    tasks = [asyncio.create_task(from_browser()), asyncio.create_task(to_browser())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await up.close()
