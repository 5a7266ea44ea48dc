"""REST client for the portal's agent API (``/api/agent/v1/...``).

Facts go up through here (docs/design.md section 1): registration, heartbeats with
GPU samples, fencing confirmations, job events and log chunks. Every call is
idempotent on the portal side, so a connection error or a 5xx is retried with
backoff; 409 means the attempt is stale and is raised as ``StaleAttempt``.

``last_contact`` (monotonic) is when the portal last *processed* a request
(2xx or 409). ``lease_renewed_at`` (monotonic) is when the last request that
renews this node's lease was *sent* (the portal records the heartbeat after
that, so the agent's lease never outlasts the portal's view of it):

- a heartbeat or registration the portal processed;
- any request the portal answered with its own outage answer (503 with the
  ``X-Gpuportal-Outage`` header: its database is out; the kit's nginx says
  ``web`` while gunicorn is not running). A portal that cannot reach its
  database cannot mark this node down either, and gives every node a fresh
  lease once it is back, so the jobs keep running through its outage;
- any request the portal's host refused (connection refused: nothing listens
  on the portal's port, so its web processes are restarting or down), unless
  ``refused_is_outage`` is off. That refusal reaches every node alike, so the
  portal hears no node: its reaper is down too (every portal process
  restarted) and gives every node a fresh lease when it is back, or it takes
  every node silent at once for its own fault (the mass-failure brake) and
  marks none down. A firewall that *rejects* one node's packets (rather than
  dropping them) looks the same to that node: where one may, turn it off
  (``--refused-is-outage off``).

- a slow portal, unless ``slow_is_outage`` is off: a 502, 503 or 504 answered on
  a direct connection (the portal's proxy has no portal behind it, or it timed
  out waiting), or a request unanswered while a fresh connection to the
  portal's host is still accepted (its kernel takes connections its frozen or
  overloaded workers have not answered yet; ``renew_if_slow``, asked by the
  agent's lease check before it fences). The portal did not process these
  heartbeats, so it cannot have counted this node silent alone: either it
  hears every node late (its reaper's lag brake moves every deadline) or none
  at all (the mass-failure brake, then a fresh lease for every node).

A reset connection, a connection that cannot even be made (a partition drops
packets: the connect times out), a 5xx through a proxy of the node's own
(``HTTPS_PROXY``: it may stand on the node's side of a partition) and no answer
at all do not renew it: that is the silence the lease is for.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
import urllib.parse

import requests

from agents import __version__
from agents.protocol import (BATCH_CONFIRM, BATCH_EVENT, CONFIRM, CONFIRMS, EVENT, EVENT_MESSAGE_MAX, EVENT_STATES,
                             EVENTS, HEARTBEAT, LOG, NODE_PROBLEM_MAX, PROBE, PROTOCOL_VERSION, REGISTER, Message)
from agents.protocol import PROGRESS, PROGRESS_MESSAGE_MAX, REGISTRY_AUTH

log = logging.getLogger(__name__)

API_PREFIX = "/api/agent/v1"


class PortalError(Exception):
    """The portal refused a request for a reason retrying will not fix (401, 400...)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class PortalUnreachable(PortalError):
    """No answer (or only 5xx answers) after all retries."""


class StaleAttempt(PortalError):
    """409: the portal has moved this job past this attempt; start or keep nothing."""


OUTAGE_HEADER = "X-Gpuportal-Outage"  # set by the portal's portal/core/middleware.py
LEASE_PATHS = ("/heartbeat", "/register")
# A proxy in front of the portal answering for it: no portal behind it (502, 503) or none in time (504).
SLOW_STATUSES = (502, 503, 504)


class PortalClient:
    def __init__(self, portal_url: str, token: str, *, timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5, max_backoff_s: float = 5.0, session: requests.Session | None = None,
                 clock=time.monotonic, sleep=time.sleep, refused_is_outage: bool = True,
                 slow_is_outage: bool = True):
        if not token.startswith("gpn_"):
            raise ValueError("--token: a node token starts with gpn_")
        self.base = portal_url.rstrip("/") + API_PREFIX
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.session = session or requests.Session()
        self.session.headers.update({
            "Authorization": f"Bearer {token}",
            "User-Agent": f"gpuportal-agent/{__version__}",
        })
        # The environment's proxy and CA bundle for the portal, read once: with trust_env, requests reads
        # them again, and ~/.netrc, on every call (a tenth of an agent's CPU per job), and a .netrc entry
        # for the portal's host would replace the node token with its password.
        env = self.session.merge_environment_settings(self.base, {}, None, None, None)
        self.session.proxies, self.session.verify = env["proxies"], env["verify"]
        self.session.trust_env = False
        self._clock = clock
        self._sleep = sleep
        self.last_contact: float | None = None
        self.lease_renewed_at: float | None = None
        # Called at each renewal, retries included (the agent rewrites the node's lease file there, so
        # the jobs' supervisors see it at once, not after a heartbeat's whole retry loop).
        self.on_lease_renewed = None
        self.portal_outage: str = ""  # what the portal last said is out ("database"), "" once it answers
        self.refused_is_outage = refused_is_outage
        # A proxy of the node's own may stand on its side of a partition: its 5xx says nothing of the portal.
        self.slow_is_outage = slow_is_outage and not requests.utils.get_environ_proxies(self.base)
        self._flight_lock = threading.Lock()
        self._in_flight = 0  # requests sent and not yet answered (nor failed)
        self._timed_out = False  # the last request ended without an answer in time (read timeout)

    # -- transport ------------------------------------------------------------

    def _outage(self, what: str, sent: float) -> None:
        """The portal's own outage (its answer says so, or its host refused the connection): the lease
        is renewed from ``sent``, and the jobs keep running (module docstring)."""
        if what != self.portal_outage:
            log.warning("the portal's %s is out; jobs keep running while it is", what)
        self.portal_outage = what
        self._renewed(sent)

    def _renewed(self, sent: float) -> None:
        self.lease_renewed_at = max(self.lease_renewed_at or sent, sent)
        if self.on_lease_renewed is not None:
            self.on_lease_renewed()

    def renew_if_slow(self, probe_timeout_s: float = 1.0) -> bool:
        """The lease check's question before it fences: is the portal slow rather than gone? True (and
        the lease renewed from now) when a request is unanswered, or the last one timed out waiting for
        its answer, and a fresh TCP connection to the portal's host is accepted within
        ``probe_timeout_s``: its host is up and reachable, only its workers do not answer (frozen,
        overloaded). A kept-alive connection proves nothing (a partition drops packets on it too), a
        fresh connect does: under a partition it times out, and the lease runs out as before."""
        if not self.slow_is_outage:
            return False
        with self._flight_lock:
            waiting = self._in_flight > 0 or self._timed_out
        if not waiting:
            return False
        probed = self._clock()
        parts = urllib.parse.urlsplit(self.base)
        try:
            with socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                          timeout=probe_timeout_s):
                pass
        except OSError as exc:
            log.debug("the portal's host did not accept a connection (%s): silence, not a slow portal", exc)
            return False
        self._outage("web (slow: connected, no answer)", probed)
        return True

    def _post(self, path: str, body: dict) -> dict:
        return self._send("POST", path, json=body)

    def _send(self, method: str, path: str, *, json: dict | None = None, stream=None,
              params: dict | None = None, headers: dict | None = None) -> dict:
        """One request, retried as the module says. ``stream``: a seekable binary file sent as the raw
        body (rewound for each try) instead of ``json``."""
        url = self.base + path
        delay = self.backoff_s
        last_err = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            sent = self._clock()
            try:
                if stream is not None:
                    stream.seek(0)
                with self._flight_lock:
                    self._in_flight += 1
                try:
                    r = self.session.request(method, url, json=json, data=stream, params=params, headers=headers,
                                             timeout=self.timeout_s)
                finally:
                    with self._flight_lock:
                        self._in_flight -= 1
            except (requests.ConnectionError, requests.Timeout) as exc:
                last_err = f"{type(exc).__name__}: {exc}"
                # Connected, then no answer in time; a connection that could not be made is silence.
                self._timed_out = isinstance(exc, requests.ReadTimeout)
                if self.refused_is_outage and _refused(exc):
                    self._outage("web (connection refused)", sent)
                    last_err = f"connection refused (portal web outage): {exc}"
                log.debug("%s %s failed (%s), attempt %d", method, path, last_err, attempt + 1)
                continue
            self._timed_out = False
            if r.status_code >= 500:
                last_err = f"HTTP {r.status_code}"
                outage = r.headers.get(OUTAGE_HEADER, "")
                if not outage and self.slow_is_outage and r.status_code in SLOW_STATUSES:
                    outage = f"web (HTTP {r.status_code})"
                if outage:
                    self._outage(outage, sent)
                    last_err += f" (portal {outage} outage)"
                continue
            self.portal_outage = ""
            if path in LEASE_PATHS and r.status_code < 400:
                self._renewed(sent)
            if r.status_code == 409:
                self.last_contact = self._clock()
                raise StaleAttempt(f"{path}: stale ({_detail(r)})", 409)
            if r.status_code >= 400:
                raise PortalError(f"{method} {path}: HTTP {r.status_code}: {_detail(r)}", r.status_code)
            self.last_contact = self._clock()
            if not r.content:
                return {}
            try:
                return r.json()
            except ValueError:
                raise PortalError(f"{method} {path}: HTTP {r.status_code} with a body that is not JSON") from None
        raise PortalUnreachable(f"{method} {url}: no answer after {self.retries + 1} tries ({last_err})")

    # -- the API ----------------------------------------------------------------

    def _report(self, message: Message, body: dict, job_id: str = "") -> dict:
        """POST one of agents.protocol's messages: its keys only, or ValueError before anything is sent."""
        return self._post("/" + message.path.format(job_id=_q(job_id)), message.body(**body))

    def register(self, *, name: str, cpus: int, memory_mb: int, sandbox: str, gpus: list[dict],
                 capabilities: dict | None = None, gpus_unusable: str = "",
                 cached_datasets: list[str] | None = None) -> dict:
        """-> {node, heartbeat_interval_s, lease_s}. ``gpus_unusable``: why the sandbox cannot give
        this node's GPUs to jobs ("" when it can); the portal keeps GPU jobs off them.
        ``cached_datasets``: the digests in the node's dataset cache."""
        body = {"name": name, "cpus": cpus, "memory_mb": memory_mb, "sandbox": sandbox, "gpus": gpus,
                "capabilities": capabilities or {}, "protocol_version": PROTOCOL_VERSION}
        if cached_datasets is not None:
            body["cached_datasets"] = list(cached_datasets)
        if gpus_unusable:
            body["gpus_unusable"] = gpus_unusable
        return self._report(REGISTER, body)

    def probe(self, nonce: str) -> dict:
        """Answer the probe the portal sent on our queue: -> {result}; StaleAttempt (409) for the
        probe of an earlier registration."""
        return self._report(PROBE, {"nonce": nonce})

    def open_dataset(self, url: str):
        """A dataset file to read (agents/datasets.py): an "agent:<path>" URL (an upload the portal keeps)
        from the agent API with this node's token, any other through plain http(s)."""
        if url.startswith("agent:"):
            r = self.session.get(self.base + url[len("agent:"):], stream=True, timeout=self.timeout_s)
            if r.status_code != 200:
                r.close()
                raise OSError(f"the portal answered {r.status_code} for {url[len('agent:'):]}")
            return r.raw
        from agents.datasets import open_url

        return open_url(url)

    def heartbeat(self, *, samples: list[dict], jobs: list[dict], cached_datasets: list[str] | None = None) -> dict:
        """-> {drain: bool, stop: [{job_id, attempt, reason}]}. ``cached_datasets``: only when they changed."""
        body = {"samples": samples, "jobs": jobs}
        if cached_datasets is not None:
            body["cached_datasets"] = list(cached_datasets)
        return self._report(HEARTBEAT, body)

    def confirm(self, job_id: str, attempt: int) -> dict:
        """Fencing: may this node start this attempt? -> the spec; StaleAttempt if not."""
        return self._report(CONFIRM, {"attempt": attempt}, job_id).get("spec") or {}

    def confirm_batch(self, confirms: list[dict]) -> list[dict]:
        """Several launches' confirmations in one request (protocol 1.7): each ``{job_id, attempt}``.
        -> one ``{job_id, result[, spec][, detail]}`` per confirmation, in order: ``result``
        "confirmed" with the launch spec, or "stale" (a single confirm's 409). A portal before 1.7
        answers PortalError 404."""
        return self._report(CONFIRMS, {"confirms": [
            BATCH_CONFIRM.body(job_id=str(c["job_id"]), attempt=int(c["attempt"])) for c in confirms]})["results"]

    def event(self, job_id: str, attempt: int, state: str, *, exit_code: int | None = None,
              message: str = "", scrub_failures: list[dict] | None = None, node_problem: str = "",
              lease_expired: bool = False, not_startable: str = "") -> dict:
        """Report a state. A terminal report names the GPUs the agent could not
        scrub (``[{"gpu_index", "message"}]``): the portal takes them out of service;
        ``node_problem`` (a sandbox that could not be killed) drains the node;
        ``lease_expired`` says the node stopped the job because its lease ran out: the
        portal requeues it as a node fault instead of failing it; ``not_startable`` (protocol 1.5) says
        why this node cannot start it now (its dataset cache is full): the portal requeues it without
        counting a failure and keeps it off this node a while."""
        return self._report(EVENT, event_body(attempt, state, exit_code=exit_code, message=message,
                                              scrub_failures=scrub_failures, node_problem=node_problem,
                                              lease_expired=lease_expired, not_startable=not_startable), job_id)

    def event_batch(self, reports: list[dict]) -> list[dict]:
        """Several jobs' reports in one request (protocol 1.2): each a dict of ``event``'s keyword
        arguments plus ``job_id``, ``attempt`` and ``state``. -> one ``{job_id, result[, detail]}`` per
        report, in order; ``result`` "stale" stands for a single report's 409. A portal before 1.2
        answers PortalError 404."""
        bodies = [{"job_id": str(r["job_id"]), **event_body(**{k: v for k, v in r.items() if k != "job_id"})}
                  for r in reports]
        return self._report(EVENTS, {"events": [BATCH_EVENT.body(**b) for b in bodies]})["results"]

    def logs(self, job_id: str, attempt: int, offset: int, data: bytes) -> dict:
        """Ship one chunk of raw output at ``offset`` (raw bytes), base64-encoded: a job may print
        anything, NUL and invalid UTF-8 included. -> {stored, size, full}; ``full`` means the
        portal keeps no more of this attempt's log."""
        return self._report(LOG, {"attempt": attempt, "offset": offset,
                                  "data_base64": base64.b64encode(data).decode("ascii")}, job_id)


    def registry_auth(self, job_id: str, attempt: int) -> dict:
        """The project's login to the registry of this attempt's image, for one pull: -> {registry,
        username, password} (both "" when the project has none there; ``problem`` when it cannot be
        used). Asked only while the attempt is assigned to this node and not yet running; StaleAttempt
        otherwise. The answer is never logged nor kept: use it for the pull and drop it."""
        return self._report(REGISTRY_AUTH, {"attempt": attempt}, job_id)

    def progress(self, job_id: str, attempt: int, stage: str, message: str) -> dict:
        """What a launch is doing before the job runs ("pulling image x:1: 43%"): the job's reason
        until it runs. StaleAttempt when the portal moved on (stop preparing it)."""
        return self._report(PROGRESS, {"attempt": attempt, "stage": stage,
                                       "message": message[:PROGRESS_MESSAGE_MAX]}, job_id)

    def artifact(self, job_id: str, attempt: int, path: str, f, size: int) -> dict:
        """Upload one file of an attempt's outputs (``path`` relative to /outputs) from the binary file
        ``f`` of ``size`` bytes, streamed. -> {path, size, sha256}; PortalError 413 past the portal's
        limits on an attempt's artifacts (the agent sends no more), StaleAttempt (409) when this attempt
        did not run here."""
        return self._send("PUT", f"/jobs/{_q(job_id)}/artifacts", stream=f, params={"attempt": attempt, "path": path},
                          headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})

    def artifact_upload_url(self, job_id: str, attempt: int, path: str, size: int) -> dict:
        """Where to upload one file of an attempt's outputs straight to the storage (protocol 1.6): ->
        {relay: false, url, method, expires_in}, or {relay: true} (send it with ``artifact``). PortalError
        413 past the attempt's limits, 404 when this attempt did not run here (or an older portal)."""
        return self._post(f"/jobs/{_q(job_id)}/artifacts/uploads", {"attempt": attempt, "path": path, "size": size})

    def artifact_confirm(self, job_id: str, attempt: int, path: str, size: int, sha256: str) -> dict:
        """Have the portal record a file PUT at its presigned URL: -> {path, size, sha256}; PortalError
        400 when the storage holds no such object or one of another size (it is deleted), 413 past the limits."""
        return self._post(f"/jobs/{_q(job_id)}/artifacts/confirm",
                          {"attempt": attempt, "path": path, "size": size, "sha256": sha256})

    def storage_put(self, url: str, f, size: int) -> None:
        """PUT the binary file ``f`` of ``size`` bytes at a presigned URL of the storage, in one request
        outside this client's session: the portal's token never goes to the storage. PortalError when
        the storage refuses it; requests' errors when it cannot be reached."""
        f.seek(0)
        r = requests.put(url, data=f if size else b"", headers={"Content-Length": str(size)}, timeout=self.timeout_s)
        if r.status_code >= 300:
            raise PortalError(f"storage PUT: HTTP {r.status_code}: {r.text[:200]}", r.status_code)


def event_body(attempt: int, state: str, *, exit_code: int | None = None, message: str = "",
               scrub_failures: list[dict] | None = None, node_problem: str = "", lease_expired: bool = False,
               not_startable: str = "") -> dict:
    """A job event's keys (agents.protocol.EVENT), alone or in a batch."""
    if state not in EVENT_STATES:
        raise ValueError(f"unknown job event state {state!r}")
    # Within the portal's field limits: a report refused for its length would leave the job running there.
    body = {"attempt": attempt, "state": state, "exit_code": exit_code, "message": message[:EVENT_MESSAGE_MAX]}
    if scrub_failures:
        body["scrub_failures"] = scrub_failures
    if node_problem:
        body["node_problem"] = node_problem[:NODE_PROBLEM_MAX]
    if lease_expired:
        body["lease_expired"] = True
    if not_startable:
        body["not_startable"] = not_startable[:NODE_PROBLEM_MAX]
    return body


def _refused(exc: BaseException) -> bool:
    """Whether a requests error is the portal's host refusing the connection (ECONNREFUSED on
    connect: urllib3's NewConnectionError raised from ConnectionRefusedError), not a timeout or reset."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return True
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None),
                 *(a for a in getattr(e, "args", ()) if isinstance(a, BaseException))]
    return False


def _q(job_id: str) -> str:
    return urllib.parse.quote(str(job_id), safe="")


def _detail(r: requests.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:200]
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("message") or body)[:200]
    return str(body)[:200]
