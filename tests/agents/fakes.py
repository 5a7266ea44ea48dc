"""Test doubles for the agent: a portal client and a sandbox driver, both in memory."""

import itertools
import threading

from agents.client import PortalError, PortalUnreachable, StaleAttempt
from agents.protocol import PROTOCOL_VERSION
from agents.sandbox import EXITED, OOM, RUNNING, SandboxError, SandboxHandle


class FakePortal:
    """Speaks the agent API like agents.client.PortalClient, records every call."""

    def __init__(self, clock):
        self.clock = clock
        self.last_contact = None
        self.lease_renewed_at = None  # as PortalClient: heartbeats and registration renew the lease
        self.unreachable = False
        self.stale: set = set()  # (job_id, attempt) the portal calls stale
        self.spec: dict = {}  # what confirm returns as the spec
        self.stop_list: list = []  # returned once by the next heartbeat
        self.events: list = []
        self.batches: list = []  # the (job_id, attempt, state) of each batched report request (protocol 1.2)
        self.log_chunks: list = []
        self.heartbeats: list = []
        self.confirms: list = []
        self.scrub_failures: list = []
        self.node_problems: list = []
        self.lease_expired: list = []  # (job_id, attempt) of ends reported as the lease's doing
        self.not_startable: list = []  # (job_id, attempt, why) of launches this node could not start (1.5)
        self.refuse_logs = 0  # log chunks to refuse with HTTP 400 before taking them
        self.refuse_events = 0  # terminal reports to refuse with HTTP 400
        self.log_cap: int | None = None  # answer full=True once this many bytes are stored

    def _call(self, key=None):
        if self.unreachable:
            raise PortalUnreachable("portal down (fake)")
        self.last_contact = self.clock()
        if key is not None and key in self.stale:
            raise StaleAttempt("stale (fake)", 409)

    def register(self, **body):
        self._call()
        self.lease_renewed_at = self.clock()
        self.registered = body
        return {"node": 7, "heartbeat_interval_s": 5, "lease_s": 30, "protocol_version": PROTOCOL_VERSION}

    def heartbeat(self, *, samples, jobs, cached_datasets=None):
        self._call()
        self.lease_renewed_at = self.clock()
        self.heartbeats.append({"samples": samples, "jobs": jobs, **(
            {"cached_datasets": cached_datasets} if cached_datasets is not None else {})})
        stop, self.stop_list = self.stop_list, []
        return {"drain": False, "stop": stop}

    def confirm(self, job_id, attempt):
        self._call((job_id, attempt))
        self.confirms.append((job_id, attempt))
        # As the real portal: a confirmation makes the attempt starting (the agent reports no `starting`).
        self.events.append((job_id, attempt, "starting", None, "confirmed"))
        return dict(self.spec)

    def event(self, job_id, attempt, state, *, exit_code=None, message="", scrub_failures=None, node_problem="",
              lease_expired=False, not_startable=""):
        self._call((job_id, attempt))
        if not_startable:
            self.not_startable.append((job_id, attempt, not_startable))
        if lease_expired:
            self.lease_expired.append((job_id, attempt))
        if self.refuse_events and state not in ("starting", "running"):
            self.refuse_events -= 1
            raise PortalError("POST events: HTTP 400: refused (fake)", 400)
        self.events.append((job_id, attempt, state, exit_code, message))
        if node_problem:
            self.node_problems.append((job_id, attempt, node_problem))
        if scrub_failures:
            self.scrub_failures.append((job_id, attempt, scrub_failures))

    def event_batch(self, reports):
        """Protocol 1.2's batch: each report as ``event`` takes it, one result each ("stale" for a 409)."""
        self._call()
        if self.refuse_events:  # as the real API: one report it refuses refuses the batch (400)
            self.refuse_events -= 1
            raise PortalError("POST events: HTTP 400: refused (fake)", 400)
        self.batches.append([(r["job_id"], r["attempt"], r["state"]) for r in reports])
        results = []
        for r in reports:
            try:
                self.event(**r)
            except StaleAttempt:
                results.append({"job_id": r["job_id"], "result": "stale"})
            else:
                results.append({"job_id": r["job_id"], "result": "applied"})
        return results

    def logs(self, job_id, attempt, offset, data):
        self._call((job_id, attempt))
        if self.refuse_logs:
            self.refuse_logs -= 1
            raise PortalError("POST logs: HTTP 400: refused (fake)", 400)
        self.log_chunks.append((job_id, attempt, offset, bytes(data)))
        size = sum(len(d) for j, a, _, d in self.log_chunks if (j, a) == (job_id, attempt))
        return {"stored": True, "size": size, "full": self.log_cap is not None and size >= self.log_cap}

    def states(self, job_id):
        return [e[2] for e in self.events if e[0] == job_id]

    def log_bytes(self, job_id):
        return b"".join(d for j, _, _, d in sorted(self.log_chunks, key=lambda x: x[2]) if j == job_id)

    def log_text(self, job_id):
        return self.log_bytes(job_id).decode("utf-8", errors="replace")


class FakeDriver:
    name = "fake"

    def __init__(self):
        self.sandboxes: dict = {}  # ref -> dict(handle, state, code, log)
        self.launched: list = []
        self.stopped: list = []
        self.removed: list = []
        self.fail_with: str | None = None
        self.read_limit: int | None = None  # read_logs returns at most this many bytes
        self.unkillable: set = set()  # job ids whose sandbox survives stop and remove (a stuck process)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def launch(self, spec):
        if self.fail_with:
            raise SandboxError(self.fail_with)
        with self._lock:
            if any(s["handle"].job_id == spec.job_id and s["handle"].attempt == spec.attempt
                   for s in self.sandboxes.values()):
                raise SandboxError("exists")
            ref = f"sbx-{next(self._ids)}"
            h = SandboxHandle(driver="fake", ref=ref, job_id=spec.job_id, attempt=spec.attempt,
                              started_at=1000.0, time_limit_s=spec.time_limit_s,
                              gpu_indexes=list(spec.gpu_indexes))
            self.sandboxes[ref] = {"handle": h, "state": RUNNING, "code": None, "log": b"", "spec": spec}
            self.launched.append(spec)
            return h

    def add_existing(self, job_id, attempt, *, gpu_indexes=()):
        ref = f"old-{job_id}-{attempt}"
        h = SandboxHandle(driver="fake", ref=ref, job_id=job_id, attempt=attempt, started_at=1000.0,
                          time_limit_s=3600, gpu_indexes=list(gpu_indexes))
        self.sandboxes[ref] = {"handle": h, "state": RUNNING, "code": None, "log": b"old output\n"}
        return h

    def by_job(self, job_id):
        return next(s for s in self.sandboxes.values() if s["handle"].job_id == job_id)

    def exit(self, job_id, code, state=EXITED):
        s = self.by_job(job_id)
        s["state"], s["code"] = state, code

    def oom(self, job_id):
        self.exit(job_id, 137, OOM)

    def poll(self, h):
        s = self.sandboxes.get(h.ref)
        return (EXITED, None) if s is None else (s["state"], s["code"])

    def read_logs(self, h, offset):
        s = self.sandboxes.get(h.ref)
        return b"" if s is None else s["log"][offset:offset + self.read_limit if self.read_limit else None]

    def stop(self, h, grace_s):
        self.stopped.append((h.job_id, h.attempt, grace_s))
        s = self.sandboxes.get(h.ref)
        if s and s["state"] == RUNNING and h.job_id not in self.unkillable:
            s["state"], s["code"] = EXITED, 143

    def list_own(self):
        return [(s["handle"].job_id, s["handle"].attempt, s["handle"]) for s in self.sandboxes.values()]

    def remove(self, h):
        self.removed.append(h.ref)
        if h.job_id not in self.unkillable:
            self.sandboxes.pop(h.ref, None)

    def running(self):
        return sorted((s["handle"].job_id, s["handle"].attempt) for s in self.sandboxes.values()
                      if s["state"] == RUNNING)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t
