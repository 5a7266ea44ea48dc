"""The node agent's logic: launch, stop, supervise, heartbeat, lease.

``Agent`` holds everything and is driven by plain method calls, so tests run
it with a fake portal client and no Celery or HTTP. In production three
callers drive it (agents/__main__.py):

- Celery tasks ``agent.launch`` / ``agent.stop`` (agents/tasks.py) call
  ``launch`` and ``stop``;
- a heartbeat thread calls ``heartbeat_once`` every ``heartbeat_interval_s``;
- a supervisor thread calls ``supervise_once`` about once a second;
- a lease thread calls ``check_lease`` twice a second, so a supervisor pass
  stuck on an unreachable portal never holds the fence up.

Invariants it keeps (docs/design.md section 6, docs/reliability.md F-04/F-05/F-09/F-10):

1. Nothing starts without the portal's confirmation of ``(job_id, attempt)``;
   a 409 at any point means "stale": start nothing, stop what runs.
2. One sandbox per ``(job_id, attempt)``: a duplicate launch starts nothing.
3. Every sandbox ends in exactly one terminal report, sent after its log tail,
   retried until the portal takes it (or calls it stale); the sandbox is kept
   until then so its logs can still be read.
4. If the portal has not processed a request for longer than the lease, every
   sandbox is stopped: by then the portal may have placed those jobs elsewhere.
5. A GPU goes back to the portal scrubbed: after the sandbox has ended and
   before the terminal report (which frees the GPUs for the next placement),
   the probe clears the memory of every GPU no other running job shares. A GPU
   that could not be cleared is named in the report, and the portal takes it
   and its node out of service (docs/reliability.md 2.2 and rule 5).
6. A job starts only on GPUs no other sandbox still holds (a whole GPU waits
   for the last job's sandbox to end, a shared one only for ending sandboxes:
   the portal frees GPUs at cancel or preemption, before the old sandbox is
   gone) and that are clean: GPUs used since their last scrub (every GPU when
   the agent starts, since a crash may have skipped one) are scrubbed first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from agents import artifacts
from agents.datasets import CacheBusy, DatasetError
from agents.client import PortalError, PortalUnreachable, StaleAttempt
from agents.protocol import DEFAULT_SANDBOX, EVENTS_MAX, NODE_SANDBOXES, sandbox_hosts
from agents.sandbox import OOM, RUNNING, LaunchSpec, SandboxError, SandboxHandle
from agents.supervisor.lease import FENCED, write_lease

log = logging.getLogger(__name__)

Key = tuple[str, int]
STOPPED = "stopped"  # _gpus_ready: a stop arrived while the launch waited
# Log chunks refused (or log reads failed) in a row before the agent gives that part of the log up.
LOG_REFUSALS = 3
# A node's launches of one pass go up together (GroupSender.gather): their confirmations wait at most
# this long for one another (the threads start within milliseconds), and their `running` reports
# this long after their confirmation (their sandboxes start, a container in a few hundred ms); a
# launch that fails sends none, so the others wait the bound out.
GATHER_S = 0.05
RUNNING_GATHER_S = 0.5
# A launch holds its `running` report this long: a job that ends meanwhile (`true`, a failed
# import) sends it with its end report, one request for both instead of two (protocol 1.2 batches).
RUNNING_HOLD_S = 0.05
# The supervisor, woken by an exit, waits this long for others before it reports: jobs of one launch
# group that end together (within milliseconds) share one request.
END_GATHER_S = 0.01
# How long before its deadline the lease check asks whether the portal is slow rather than gone (at most a
# third of the lease): the probe takes up to a second, and the renewal must reach the lease file in time.
SLOW_PROBE_AHEAD_S = 2.0


@dataclass
class Tracked:
    """One sandbox this agent looks after, from launch (or adoption) to its report."""

    job_id: str
    attempt: int
    handle: SandboxHandle
    log_offset: int = 0  # raw bytes of the sandbox's log the portal has taken
    log_full: bool = False  # the portal holds as much of this attempt's log as it keeps: ship no more
    log_failures: int = 0  # log chunks refused (or unreadable) in a row; past a few, the chunk is given up
    report_refusals: int = 0  # terminal reports the portal refused (HTTP 4xx other than 409)
    # Set when *we* end the job (stop, time limit, lease): the state to report.
    stop_state: str | None = None
    stop_reason: str = ""
    # (state, exit_code, message), decided and waiting to be reported.
    terminal: tuple[str, int | None, str] | None = None
    # The GPUs this job left that could not be scrubbed; None until the scrub ran.
    scrub_failures: list[dict] | None = None
    # Set when the sandbox outlived SIGKILL: the report asks the portal to drain the node.
    node_problem: str = ""
    # The upload of its outputs (agents/artifacts.py): progress, the note for its report once done.
    outputs: artifacts.Upload = field(default_factory=artifacts.Upload)
    outputs_note: str | None = None
    outputs_failures: int = 0
    outputs_thread: threading.Thread | None = None
    # Set when the node ended it because its lease ran out (the agent's fence, or the job's supervisor's):
    # the report says so and the portal requeues the job as a node fault, not the job's failure.
    lease_expired: bool = False
    # Its `running` report is still to go (RUNNING_HOLD_S): whichever of the launch and the end report
    # takes it under `running_lock` sends it, so it goes once and never after the end.
    running_due: bool = False
    running_lock: threading.Lock = field(default_factory=threading.Lock)
    end_waits: bool = False  # its end report waited for the `running` report in flight
    exited: threading.Event = field(default_factory=threading.Event)  # the driver saw the sandbox end
    # A checkpointing job's (signal, grace_s) from its spec: sent grace_s before its time limit.
    checkpoint: tuple[str, float] | None = None
    warned: bool = False  # the time-limit signal went out
    # While it stops: by when (agent clock) it will be gone, for launches waiting for its GPUs.
    stop_deadline: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> Key:
        return (self.job_id, self.attempt)


class GroupSender:
    """Reports of several threads in one request (group commit): a thread whose report finds no request
    in flight sends it with every report queued meanwhile, up to ``EVENTS_MAX``; the others wait for its
    answer, so launches that go together share their ``starting`` and ``running`` requests and none
    waits for a timer. ``send_many(reports)`` returns one outcome a report (a result, or the exception).

    ``gather(n, within_s)`` says n reports are coming together (a node's launches of one pass): the
    next request waits for them, up to ``within_s``, rather than going with the first alone."""

    def __init__(self, send_many):
        self._send_many = send_many
        self._cond = threading.Condition()
        self._queue: list[dict] = []
        self._busy = False
        self._gather, self._gather_until = 0, 0.0

    def gather(self, n: int, within_s: float) -> None:
        with self._cond:
            self._gather, self._gather_until = n, time.monotonic() + within_s

    def send(self, report: dict):
        slot = {"report": report, "done": False, "outcome": None}
        with self._cond:
            self._queue.append(slot)
            self._cond.notify_all()  # a sender gathering a group counts it
        while True:
            with self._cond:
                while self._busy and not slot["done"]:
                    self._cond.wait()
                if slot["done"]:
                    return slot["outcome"]
                self._busy = True
                while len(self._queue) < self._gather and (left := self._gather_until - time.monotonic()) > 0:
                    self._cond.wait(left)
                self._gather = 0
                batch, self._queue = self._queue[:EVENTS_MAX], self._queue[EVENTS_MAX:]
            try:
                outcomes = self._send_many([s["report"] for s in batch])
            except Exception as exc:  # a bug must not leave the other launches waiting for good
                outcomes = [exc] * len(batch)
            with self._cond:
                for s, outcome in zip(batch, outcomes):
                    s["outcome"], s["done"] = outcome, True
                self._busy = False
                self._cond.notify_all()

    def forgo(self) -> None:
        """One of the ``gather``ed reports will not come (its job's end report carries it): the
        request waits for one fewer."""
        with self._cond:
            if self._gather:
                self._gather -= 1
                self._cond.notify_all()


class Agent:
    def __init__(self, *, name: str, client, driver, probe, stop_grace_s: float = 10.0,
                 log_chunk_bytes: int = 256 * 1024, background: bool = True, scrub_gpus: bool = True,
                 clock=time.monotonic, wall=time.time, datasets=None, running_hold_s: float = 0.0,
                 end_gather_s: float = 0.0):
        self.name = name
        # The node's dataset cache (agents/datasets.DatasetCache); None: jobs naming datasets are refused.
        self.datasets = datasets
        self._datasets_sent: list[str] | None = None  # what the portal last took as this node's cached digests
        self.client = client
        self.driver = driver
        self.probe = probe
        self.stop_grace_s = stop_grace_s
        self.log_chunk_bytes = log_chunk_bytes
        # A running job's log ships at most this much a pass, so one chatty job cannot hold up the others.
        self.log_pass_bytes = 4 * log_chunk_bytes
        self.scrub_gpus = scrub_gpus
        # GPUs a job may have written since their last scrub; at start we cannot know.
        self._dirty: set[int] = {g.index for g in probe.inventory()}
        # How long a launch waits, beyond the stop grace, for another sandbox to let go of its GPUs.
        self.gpu_release_wait_s = 60.0
        # How long a killed sandbox may take to go (a VM's teardown) before it counts as unkillable.
        self.kill_wait_s = 30.0
        # Stops run on their own threads so one job's grace period never holds
        # up log shipping, heartbeats or other stops; tests turn this off.
        self.background = background
        self._clock = clock
        self._wall = wall
        self.heartbeat_interval_s = 10.0
        self.lease_s = 60.0
        # SIGTERM grace when the lease runs out: the portal may start these jobs elsewhere once
        # the lease, this grace and a margin have passed (portal/settings.py, NODE_TIMEOUT_S).
        self.fence_grace_s = 3.0
        self.node_id = None
        self.drain = False
        self.fenced = False  # True after the lease ran out, until the portal answers again
        self._started = clock()
        self._lease_file_lock = threading.Lock()
        self._lease_written = None  # (renewed at, lease, fence grace) of the lease file's last write
        if hasattr(client, "on_lease_renewed"):  # each renewal reaches the lease file at once, retries included
            client.on_lease_renewed = self.write_lease
        self._lock = threading.RLock()
        self._jobs: dict[Key, Tracked] = {}
        self._launching: set[Key] = set()
        self._launch_gpus: dict[Key, set[int]] = {}  # GPUs of launches past their wait, not yet tracked
        self._scrubbing: set[int] = set()  # GPUs a scrub is clearing right now
        self._pending_stop: dict[Key, tuple[str, float, str | None]] = {}
        self._unsent_xids: dict[str, list[int]] = {}
        self._stop_threads: list[threading.Thread] = []
        # Sandboxes a driver saw end (a pidfd, Docker's die event): the supervisor wakes for them at
        # once instead of at its next tick (run_supervisor). None: one ended, which is not known.
        self._ended: set[str | None] = set()
        self._wake = threading.Event()
        # Ends seen before the launch that started the sandbox tracked it (a job like `true`): by ref,
        # when seen; the launch hands them to the supervisor once it tracks the sandbox.
        self._early_ends: dict[str, float] = {}
        # Ends of several jobs go up in one request (protocol 1.2); off for a portal that speaks an older one.
        self.batch_events = True
        self.running_hold_s = running_hold_s  # 0: each launch reports `running` at once (RUNNING_HOLD_S)
        self.end_gather_s = end_gather_s  # 0: an exit is reported as soon as it is seen (END_GATHER_S)
        # `starting` and `running` reports of launches that go together share requests (protocol 1.2).
        self._launch_reports = GroupSender(self._send_launch_reports)
        # Confirmations of launches that go together (a node's launches of one pass) share requests
        # (protocol 1.7); off for a portal that speaks an older one.
        self.batch_confirms = True
        self._confirms = GroupSender(self._send_confirms)
        self._supervising = False  # run_supervisor's loop runs: stop threads hand their ends to its passes
        self.says_not_startable = True  # the portal takes not_startable (protocol 1.5); register says

    # -- start-up ---------------------------------------------------------------

    def register(self) -> dict:
        gpus = [g.as_dict() for g in self.probe.inventory()]
        # A sandbox that cannot hand GPUs to jobs (docker without the NVIDIA runtime) says why: the
        # portal then keeps GPU jobs off this node instead of sending launches that would fail.
        problem = getattr(self.driver, "gpu_problem", lambda: None)() if gpus else None
        if problem:
            log.warning("this node's GPUs cannot serve %s jobs: %s; registering them as unusable (CPU jobs still run)",
                        self.driver.name, problem)
        cached = self.datasets.digests() if self.datasets is not None else []
        resp = self.client.register(name=self.name, cpus=os.cpu_count() or 1, memory_mb=_memory_mb(),
                                    sandbox=self.driver.name, gpus=gpus, capabilities=capabilities(self.probe),
                                    gpus_unusable=problem or "", cached_datasets=cached)
        self._datasets_sent = cached
        self.node_id = resp.get("node")
        self.batch_events = _speaks(resp.get("protocol_version"), (1, 2))
        self.says_not_startable = _speaks(resp.get("protocol_version"), (1, 5))
        self.batch_confirms = _speaks(resp.get("protocol_version"), (1, 7))
        self.heartbeat_interval_s = float(resp.get("heartbeat_interval_s") or self.heartbeat_interval_s)
        self.lease_s = float(resp.get("lease_s") or self.lease_s)
        self.fence_grace_s = float(resp.get("fence_grace_s", self.fence_grace_s))
        if hasattr(self.driver, "lease_path"):
            self.driver.lease_s, self.driver.fence_grace_s = self.lease_s, self.fence_grace_s
        self.write_lease()
        log.info("registered as %s (node %s): %d GPU(s) via %s probe, %s sandbox, heartbeat %ss, lease %ss",
                 self.name, self.node_id, len(gpus), self.probe.kind, self.driver.name,
                 self.heartbeat_interval_s, self.lease_s)
        return resp

    def answer_probe(self, nonce: str) -> str:
        """The portal's probe came through our queue: tell it, and the node takes jobs."""
        try:
            result = self.client.probe(nonce).get("result", "")
        except StaleAttempt:
            log.info("queue probe %s… is from an earlier registration; ignored", nonce[:8])
            return "stale"
        log.info("queue probe answered (%s): the portal sends this node jobs now", result)
        return result

    def reconcile(self) -> list[Key]:
        """Adopt the sandboxes a previous run of this agent left (found by label).

        The next heartbeat reports them; the portal names the stale ones in its
        ``stop`` list. Their logs are re-shipped from offset 0 (idempotent).
        """
        adopted = []
        for job_id, attempt, handle in self.driver.list_own():
            with self._lock:
                if (job_id, attempt) in self._jobs:
                    continue
                self._jobs[(job_id, attempt)] = Tracked(job_id, attempt, handle)
                self._dirty.update(handle.gpu_indexes)
            self._set_busy(handle.gpu_indexes, True)
            adopted.append((job_id, attempt))
        if self.datasets is not None:  # references of launches that left no sandbox behind are gone
            with self._lock:
                self.datasets.keep_only({f"{j}:{a}" for j, a in self._jobs})
        if adopted:
            log.info("reconcile: adopted %d sandbox(es) from a previous run: %s", len(adopted), adopted)
        return adopted

    # -- commands from the portal (Celery tasks) --------------------------------

    def launch(self, job_id: str, attempt: int, spec: dict) -> str:
        """Start one attempt of a job. Returns what happened, for logs and tests:
        ``started``, ``duplicate``, ``stale`` or ``failed``.

        Raises PortalUnreachable when confirmation is impossible, so the task
        can retry: without a confirmation nothing may start.
        """
        key = (str(job_id), int(attempt))
        job_id, attempt = key
        with self._lock:
            if key in self._jobs or key in self._launching:
                log.info("job %s attempt %s: duplicate launch, already here", job_id, attempt)
                return "duplicate"
            self._launching.add(key)
        try:
            return self._launch(job_id, attempt, spec)
        finally:
            with self._lock:
                self._launching.discard(key)
                self._launch_gpus.pop(key, None)
                self._pending_stop.pop(key, None)  # nothing started: nothing left to stop

    def _launch(self, job_id: str, attempt: int, spec: dict) -> str:
        held = self._lease_renewed()  # the lease this confirmation stands on
        try:
            confirmed = self._confirm(job_id, attempt)
        except StaleAttempt:
            log.info("job %s attempt %s: portal says stale, starting nothing", job_id, attempt)
            return "stale"
        self.write_lease()  # the job's supervisor reads it from its start
        # The confirmed spec comes from the portal's database at this moment; it wins.
        wanted = {**(spec or {}), **confirmed}.get("sandbox") or DEFAULT_SANDBOX
        if self.driver.name in NODE_SANDBOXES and self.driver.name not in sandbox_hosts(wanted):
            # The scheduler never places it so; a node re-registered with another sandbox might.
            return self._launch_failed(job_id, attempt, f"the job asks for the {wanted} sandbox; node {self.name} "
                                                        f"runs {self.driver.name} sandboxes")
        try:
            ls = LaunchSpec.from_dict({**(spec or {}), **confirmed}, job_id=job_id, attempt=attempt,
                                      inventory=self.probe.inventory())
        except SandboxError as exc:
            return self._launch_failed(job_id, attempt, f"bad spec: {exc}")
        with self._lock:
            older = [t for t in self._jobs.values() if t.job_id == job_id and t.attempt < attempt]
        for t in older:  # the portal moved on, so the older attempt is stale here
            self._begin_stop(t, "cancelled", f"superseded by attempt {attempt}", self.stop_grace_s)
        # No `starting` report: the confirmation just made the attempt starting on the portal (every
        # protocol version), and the `running` report fences the launch once more.
        if ls.datasets:
            problem = self._stage_datasets(ls)
            if problem == STOPPED:
                return self._launch_stopped(job_id, attempt)
            if isinstance(problem, CacheBusy):
                return self._launch_failed(job_id, attempt, str(problem), not_startable=(
                    f"dataset cache full on node {self.name}: {problem}"))
            if problem:
                return self._launch_failed(job_id, attempt, problem)
        try:
            return self._launch_staged(job_id, attempt, ls, held)
        finally:
            with self._lock:
                started = (job_id, attempt) in self._jobs
            if ls.dataset_paths and not started and self.datasets is not None:
                self.datasets.release(f"{job_id}:{attempt}")

    def _stage_datasets(self, ls: LaunchSpec):
        """The launch's datasets in the node's cache (fetched once per node, checksums verified), their
        folders in ``ls.dataset_paths``; progress goes to the portal as the job's reason. Returns None,
        STOPPED (a stop came meanwhile), CacheBusy (no room here now: another node may start it) or why
        not, for the job's owner."""
        if self.datasets is None:
            return "this job names datasets but the node has no dataset cache (agent option --dataset-cache-mb)"
        key = (ls.job_id, ls.attempt)

        def progress(text: str) -> None:
            try:
                self.client.progress(ls.job_id, ls.attempt, "staging", text)
            except StaleAttempt:
                with self._lock:  # the portal moved on: stop fetching for it
                    self._pending_stop.setdefault(key, ("stale attempt", self.stop_grace_s, None))
            except PortalError:
                pass  # only the job's reason; the launch goes on

        def cancelled() -> bool:
            with self._lock:
                return key in self._pending_stop

        try:
            ls.dataset_paths = self.datasets.acquire(f"{ls.job_id}:{ls.attempt}", ls.datasets, progress=progress,
                                                     cancelled=cancelled)
        except CacheBusy as exc:
            return STOPPED if cancelled() else exc
        except DatasetError as exc:
            return STOPPED if cancelled() else str(exc)
        return None

    def prefetch(self, datasets: list[dict]) -> str:
        """Fetch datasets (launch-spec entries) into the cache before a job that needs them is placed here
        (the scheduler reserved this node for it): ``fetched``, ``cached`` or why not. Nothing holds them
        afterwards: the job's launch does."""
        if self.datasets is None or not datasets:
            return "no dataset cache" if self.datasets is None else "cached"
        before = set(self.datasets.digests())
        try:
            self.datasets.acquire("prefetch", datasets)
        except DatasetError as exc:
            log.warning("prefetch: %s", exc)
            return str(exc)
        finally:
            self.datasets.release("prefetch")
        return "cached" if {d.get("digest") for d in datasets} <= before else "fetched"

    def _launch_staged(self, job_id: str, attempt: int, ls: LaunchSpec, held: float) -> str:
        pulled = self._prepare_image(ls)
        if pulled is not None:
            return pulled
        problem = self._gpus_ready(ls)
        if problem == STOPPED:
            return self._launch_stopped(job_id, attempt)
        if problem:
            # Not the job's fault: the report asks the portal to requeue it and to look at this node.
            return self._launch_failed(job_id, attempt, problem[0], scrub_failures=problem[1], node_problem=problem[0])
        if not self._confirmation_holds(job_id, attempt, held):
            return "stale"
        try:
            handle = self.driver.launch(ls)
        except SandboxError as exc:
            if self._adopt_existing(job_id, attempt):
                return "duplicate"
            with self._lock:
                stopped = (job_id, attempt) in self._pending_stop
            if stopped:  # the stop ended the launch (kvm: its image conversion): cancelled, not failed
                return self._launch_stopped(job_id, attempt)
            return self._launch_failed(job_id, attempt, str(exc))
        except Exception as exc:  # a driver bug (or a full disk) must still end the job once
            log.exception("job %s attempt %s: the %s driver failed unexpectedly", job_id, attempt, self.driver.name)
            return self._launch_failed(job_id, attempt, f"could not start the sandbox: {type(exc).__name__}: {exc}")
        t = Tracked(job_id, attempt, handle, running_due=True)
        if ls.checkpoint_signal and ls.checkpoint_grace_s:
            t.checkpoint = (ls.checkpoint_signal, float(ls.checkpoint_grace_s))
        with self._lock:
            self._jobs[t.key] = t
            if self._early_ends.pop(handle.ref, None) is not None:
                self._ended.add(handle.ref)
                self._wake.set()
            if handle.ref in self._ended:
                t.exited.set()
            self._dirty.update(handle.gpu_indexes)
            pending = self._pending_stop.pop(t.key, None)
        self._set_busy(handle.gpu_indexes, True)
        log.info("job %s attempt %s: started (%s %s)", job_id, attempt, self.driver.name, handle.ref)
        if pending:
            self._begin_stop(t, "cancelled", pending[0], pending[1], signal=pending[2])
            return "started"
        if self._clock() - self._lease_renewed() > self.lease_s:
            # The lease ran out while the sandbox started (a slow engine after the last check): the fence
            # stopped every job it knew, not this one, which the portal may be re-placing now. Stop it as
            # the fence does, before anything else.
            log.error("job %s attempt %s: the lease ran out while it started; stopping it", job_id, attempt)
            self._begin_stop(t, "failed", "stopped by the agent: the lease ran out while the sandbox started",
                             min(self.stop_grace_s, self.fence_grace_s), lease_expired=True)
            return "started"
        if self._folds_running() and self.running_hold_s > 0 and t.exited.wait(self.running_hold_s):
            self._launch_reports.forgo()
            return "started"  # it ended at once: its end report carries `running` (_report_batch)
        try:
            self._report_running(t)
        except StaleAttempt:
            self._begin_stop(t, "cancelled", "stale attempt", self.stop_grace_s)
        except PortalUnreachable:
            log.warning("job %s attempt %s: could not report running; the heartbeat will", job_id, attempt)
        return "started"

    def _report_running(self, t: Tracked) -> None:
        """``t``'s `running` report, unless its end report took it. An end report meanwhile waits for
        this one's answer (_take_running), and is woken once it is in."""
        try:
            with t.running_lock:
                if not t.running_due:
                    self._launch_reports.forgo()
                    return
                try:
                    self._report_state(t.job_id, t.attempt, "running")
                except PortalUnreachable:
                    raise  # still due: the end report carries it
                except Exception:
                    t.running_due = False
                    raise
                t.running_due = False
        finally:
            if t.end_waits:
                t.end_waits = False
                self.sandbox_ended(t.handle.ref)

    def _folds_running(self) -> bool:
        """Whether an end report may carry its job's `running` report (a portal taking batches)."""
        return self.batch_events and hasattr(self.client, "event_batch")

    def _carries_running(self, t: Tracked) -> bool:
        """Whether ``t``'s end report goes with its `running` report, as things stand (_take_running)."""
        return t.running_due and self._folds_running()

    def _take_running(self, t: Tracked) -> bool | None:
        """Whether ``t``'s end report is to carry its `running` report (it was not sent, and now will not
        be by the launch); None while the launch is sending it: the end waits for its answer (the
        launch then wakes the supervisor), never the supervisor, whom a slow portal would hold up."""
        if not self._carries_running(t):
            return False
        if not t.running_lock.acquire(blocking=False):
            t.end_waits = True
            return None
        try:
            due, t.running_due = t.running_due, False
        finally:
            t.running_lock.release()
        return due

    def expect_launches(self, n: int) -> None:
        """``n`` launches start now side by side (a node's launches of one pass, agents/tasks.py): their
        confirmations go up in one request, and so, once confirmed, do their ``running`` reports."""
        if n > 1 and self.batch_confirms:  # one by one, they go faster each from its own thread
            self._confirms.gather(n, GATHER_S)

    def _confirm(self, job_id: str, attempt: int) -> dict:
        """``client.confirm``, in one request with the other launches confirming meanwhile
        (``GroupSender``): the launch spec, or raises as ``client.confirm`` does."""
        outcome = self._confirms.send({"job_id": job_id, "attempt": attempt})
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _send_confirms(self, confirms: list[dict]) -> list:
        """Confirmations in one request where the portal takes batches (protocol 1.7), else one by one:
        each one's launch spec, or StaleAttempt, or what its request raised."""
        try:
            results = self._batch_answers("batch_confirms", "confirm_batch", confirms)
        except PortalUnreachable as exc:
            return [exc] * len(confirms)
        if results is None:
            return [self._confirm_one(c) for c in confirms]
        confirmed = sum(r.get("result") == "confirmed" for r in results)
        if confirmed > 1 and self.batch_events:  # they start side by side: their `running` reports too
            self._launch_reports.gather(confirmed, RUNNING_GATHER_S)
        return [r.get("spec") or {} if r.get("result") == "confirmed" else
                StaleAttempt(f"job {c['job_id']} attempt {c['attempt']}: {r.get('detail') or 'stale'}", 409)
                for c, r in zip(confirms, results)]

    def _batch_answers(self, flag: str, method: str, items: list[dict]) -> list[dict] | None:
        """The portal's answers to ``client.<method>(items)``, one per item, or None where it is not to be
        asked so (one item, or ``self.<flag>`` off) or did not answer so: a portal that answers 404 or 405
        takes no batches, and ``self.<flag>`` turns off. Raises PortalUnreachable."""
        if len(items) < 2 or not getattr(self, flag) or not hasattr(self.client, method):
            return None
        try:
            results = getattr(self.client, method)(items)
        except PortalUnreachable:
            raise
        except PortalError as exc:
            if exc.status in (404, 405):
                setattr(self, flag, False)
            return None
        return results if len(results) == len(items) else None

    def _confirm_one(self, confirm: dict):
        try:
            return self.client.confirm(confirm["job_id"], confirm["attempt"])
        except PortalError as exc:  # StaleAttempt among them
            return exc

    def _report_state(self, job_id: str, attempt: int, state: str) -> None:
        """Report a launch's ``starting`` or ``running``; launches that report together share one request
        (``GroupSender``). Raises as ``client.event`` does (StaleAttempt: the portal moved on)."""
        outcome = self._launch_reports.send({"job_id": job_id, "attempt": attempt, "state": state})
        if outcome == "stale":
            raise StaleAttempt(f"job {job_id} attempt {attempt}: stale")
        if isinstance(outcome, Exception):
            raise outcome

    def _send_launch_reports(self, reports: list[dict]) -> list:
        """Launch reports in one request where the portal takes batches (protocol 1.2), else one by one:
        each one's "applied", "duplicate" or "stale", or what its request raised."""
        try:
            results = self._batch_answers("batch_events", "event_batch", reports)
        except PortalUnreachable as exc:
            return [exc] * len(reports)
        if results is None:
            return [self._send_one_launch_report(r) for r in reports]
        return [r.get("result") or "applied" for r in results]

    def _send_one_launch_report(self, report: dict):
        try:
            self.client.event(report["job_id"], report["attempt"], report["state"])
        except StaleAttempt:
            return "stale"
        except PortalError as exc:
            return exc
        return "applied"

    def _prepare_image(self, ls: LaunchSpec) -> str | None:
        """Have the driver make the job's image present (docker: pulled with the project's registry
        login, asked from the portal only when a pull is needed, its progress the job's reason)
        before the launch waits for GPUs. None: go on; else the launch's result."""
        prepare = getattr(self.driver, "prepare_image", None)
        if prepare is None:
            return None
        key = (ls.job_id, ls.attempt)

        def stopped() -> bool:
            with self._lock:
                return key in self._pending_stop

        def progress(text: str) -> None:
            try:
                self.client.progress(ls.job_id, ls.attempt, "pulling", text)
            except StaleAttempt:
                raise
            except PortalError as exc:  # only the reason is late; the pull goes on
                log.info("job %s attempt %s: could not report the pull's progress: %s", ls.job_id, ls.attempt, exc)

        def credentials() -> dict:
            try:
                return self.client.registry_auth(ls.job_id, ls.attempt)
            except (StaleAttempt, PortalUnreachable):
                raise  # stale: start nothing; unreachable: the launch task retries
            except PortalError as exc:  # a portal without private images (404), say
                raise SandboxError(f"image {ls.image}: the portal gave no registry login for it ({exc})") from None

        try:
            how = prepare(ls, credentials=credentials, progress=progress, stopped=stopped)
        except StaleAttempt:
            log.info("job %s attempt %s: stale while its image was prepared; starting nothing", ls.job_id, ls.attempt)
            return "stale"
        except SandboxError as exc:
            if stopped():
                return self._launch_stopped(ls.job_id, ls.attempt)
            return self._launch_failed(ls.job_id, ls.attempt, str(exc))
        if how == "pulled":
            log.info("job %s attempt %s: image %s pulled", ls.job_id, ls.attempt, ls.image)
        return None

    def _lease_renewed(self) -> float:
        renewed = getattr(self.client, "lease_renewed_at", None)
        return renewed if renewed is not None else self._started

    def _confirmation_holds(self, job_id: str, attempt: int, held: float) -> bool:
        """A confirmation counts within the lease that was current when it was asked for: while that
        lease runs, the portal cannot have reaped this node and re-placed the job. Past it (the agent
        was frozen or cut off, or the launch waited long for GPUs or an image) the node may have been
        reaped and come back meanwhile, so the portal is asked again, under a lease valid now.
        Raises PortalUnreachable when it cannot be (the task retries); False: stale, start nothing."""
        if self._clock() - held <= self.lease_s:
            return True
        held = self._lease_renewed()
        if self._clock() - held > self.lease_s:
            raise PortalUnreachable(f"job {job_id} attempt {attempt}: the lease ran out during the launch; "
                                    "not starting it on an old confirmation")
        try:
            self.client.confirm(job_id, attempt)
        except StaleAttempt:
            log.info("job %s attempt %s: stale by the time it could start (the lease ran out meanwhile); "
                     "starting nothing", job_id, attempt)
            return False
        if self._clock() - held > self.lease_s:
            raise PortalUnreachable(f"job {job_id} attempt {attempt}: the lease ran out during the launch")
        return True

    def _adopt_existing(self, job_id: str, attempt: int) -> bool:
        """A sandbox for this attempt already exists (an earlier run of the
        agent started it): track it instead of starting another."""
        for j, a, handle in self.driver.list_own():
            if (j, a) == (job_id, attempt):
                with self._lock:
                    self._jobs.setdefault((j, a), Tracked(j, a, handle))
                log.info("job %s attempt %s: sandbox already exists, adopted it", job_id, attempt)
                return True
        return False

    def _gpus_ready(self, ls: LaunchSpec):
        """Wait until no other sandbox holds this job's GPUs and none is being scrubbed, then scrub
        those not clean (invariant 6). Returns None when the job may start, STOPPED when a stop came
        meanwhile, else (why not, scrub failures)."""
        want = set(ls.gpu_indexes)
        if not want:
            return None
        key = (ls.job_id, ls.attempt)
        exclusive = ls.gpu_fraction is None
        waited = self.stop_grace_s + self.gpu_release_wait_s
        deadline = time.monotonic() + waited
        while True:
            with self._lock:
                if key in self._pending_stop:
                    return STOPPED
                # A sandbox checkpointing on these GPUs may take its whole grace: wait for it.
                saving = [t.stop_deadline for t in self._jobs.values() if t.key != key and t.stop_deadline
                          and t.terminal is None and want & set(t.handle.gpu_indexes)]
                if saving:
                    later = max(saving) - self._clock() + self.gpu_release_wait_s
                    if later > deadline - time.monotonic():
                        waited += later - (deadline - time.monotonic())
                        deadline = time.monotonic() + later
                held = want & ({i for t in self._jobs.values() if t.key != key and (exclusive or t.terminal or t.stop_state)
                                for i in t.handle.gpu_indexes}
                               | ({i for k, g in self._launch_gpus.items() if k != key for i in g} if exclusive else set())
                               | self._scrubbing)
                if not held:
                    self._launch_gpus[key] = want  # from now on other launches and scrubs see these GPUs as used
                    claimed = self._claim_locked(want & self._dirty, key)
                    break
            if time.monotonic() >= deadline:
                return (f"GPU(s) {sorted(held)} still held by another job's sandbox after {waited:.0f}s; "
                        f"not starting on them", [])
            time.sleep(0.1)
        failed = self._scrub_gpus(claimed)
        if failed:
            return (f"GPU(s) {sorted(failed)} could not be scrubbed before the job: "
                    + "; ".join(f"{i}: {why}" for i, why in sorted(failed.items())), _failure_list(failed))
        return None

    def _claim_locked(self, indexes, key: Key) -> list[int]:
        """Of ``indexes``, those no running job, other launch or scrub uses, marked as being scrubbed.
        Call with ``self._lock`` held; ``_scrub_gpus`` releases them."""
        used = {i for t in self._jobs.values() if t.key != key and t.terminal is None and t.stop_state is None
                for i in t.handle.gpu_indexes}
        used |= {i for k, g in self._launch_gpus.items() if k != key for i in g}
        used |= self._scrubbing
        claimed = sorted(set(indexes) - used)
        self._scrubbing.update(claimed)
        return claimed

    def _launch_stopped(self, job_id: str, attempt: int) -> str:
        """A stop arrived while the launch was under way: report ``cancelled`` with its reason, start nothing."""
        with self._lock:
            reason = self._pending_stop.get((job_id, attempt), ("stopped by the portal",))[0]
        log.info("job %s attempt %s: stopped before it started (%s); starting nothing", job_id, attempt, reason)
        try:
            self.client.event(job_id, attempt, "cancelled", message=reason)
        except (StaleAttempt, PortalUnreachable):
            pass  # the portal ended it already: that is why it sent the stop
        return "stale"

    def _launch_failed(self, job_id: str, attempt: int, message: str, scrub_failures=(), node_problem="",
                       not_startable="") -> str:
        """Report a launch that started nothing as failed; with ``not_startable`` (a portal of protocol 1.5
        or later) the portal requeues it elsewhere instead, counting no failure."""
        log.error("job %s attempt %s: launch failed: %s", job_id, attempt, not_startable or message)
        try:
            self.client.event(job_id, attempt, "failed", message=message, scrub_failures=list(scrub_failures),
                              node_problem=node_problem,
                              **({"not_startable": not_startable} if not_startable and self.says_not_startable else {}))
        except (StaleAttempt, PortalUnreachable) as exc:
            log.warning("job %s attempt %s: could not report the failure: %s", job_id, attempt, exc)
        return "failed"

    def stop(self, job_id: str, attempt: int, reason: str = "", grace_s: float | None = None,
             *, signal: str | None = None, wait: bool = True) -> bool:
        """Stop one attempt (SIGTERM, grace, kill) and report it ``cancelled``
        with ``reason``. With ``signal`` (a checkpointing job moved elsewhere): that signal first,
        up to ``grace_s`` for the job to save and exit, then SIGTERM, the agent's stop grace and
        SIGKILL. Returns False when this agent has no such sandbox."""
        key = (str(job_id), int(attempt))
        grace = self.stop_grace_s if grace_s is None else float(grace_s)
        with self._lock:
            t = self._jobs.get(key)
            if t is None:
                if key in self._launching:  # stop overtook its launch: apply it on arrival
                    self._pending_stop[key] = (reason, grace, signal)
                    cancel = getattr(self.driver, "cancel_launch", None)
                    if cancel:  # kvm: ends a slow image conversion instead of starting a VM to stop it
                        cancel(*key)
                    return True
                log.info("job %s attempt %s: stop for a sandbox this node does not have", *key)
                return False
        self._begin_stop(t, "cancelled", reason or "stopped by the portal", grace, signal=signal, wait=wait)
        return True

    # -- ending sandboxes ---------------------------------------------------------

    def _begin_stop(self, t: Tracked, state: str, reason: str, grace_s: float, *, wait: bool = False,
                    lease_expired: bool = False, signal: str | None = None) -> None:
        if signal and not hasattr(self.driver, "signal"):
            signal = None  # kvm: its stop already asks the guest to shut down within the grace
        with self._lock:
            if t.stop_state is not None or t.terminal is not None:
                return  # already ending; the first reason stands
            t.stop_state, t.stop_reason, t.lease_expired = state, reason, lease_expired
            t.stop_deadline = self._clock() + grace_s + (self.stop_grace_s if signal else 0.0)
        log.info("job %s attempt %s: stopping (%s: %s, %sgrace %ss)", t.job_id, t.attempt, state, reason,
                 f"{signal} to checkpoint, " if signal else "", grace_s)
        if wait or not self.background:
            self._do_stop(t, grace_s, signal)
        else:
            th = threading.Thread(target=self._do_stop, args=(t, grace_s, signal, True), daemon=True,
                                  name=f"stop-{t.job_id}-{t.attempt}")
            th.start()
            self._stop_threads = [x for x in self._stop_threads if x.is_alive()] + [th]

    def _do_stop(self, t: Tracked, grace_s: float, signal: str | None = None, handover: bool = False) -> None:
        try:
            if signal:
                self._checkpoint_then_wait(t, signal, grace_s)
            self.driver.stop(t.handle, self.stop_grace_s if signal else grace_s)
            state, code = self.driver.poll(t.handle)
        except Exception:  # a sandbox we cannot kill must not kill the agent
            log.exception("job %s attempt %s: stop failed; will try again", t.job_id, t.attempt)
            with self._lock:
                t.stop_state = None  # lets the time limit, lease or portal ask again
            return
        reason = t.stop_reason
        deadline = time.monotonic() + self.kill_wait_s
        while state == RUNNING and time.monotonic() < deadline:  # a VM's teardown may take a while
            time.sleep(0.5)
            state, code = self.driver.poll(t.handle)
        if state == RUNNING:
            # Still there after SIGKILL (a process stuck in the kernel, a wedged engine): the job is over for
            # the portal, but this node must take no more work until someone looks (docs/reliability.md F-15).
            t.node_problem = f"the sandbox of job {t.job_id} attempt {t.attempt} could not be killed"
            log.error("job %s attempt %s: %s", t.job_id, t.attempt, t.node_problem)
            reason = f"{reason}; {t.node_problem}"
        with self._lock:
            t.terminal = (t.stop_state, code, reason)
        if handover and self._supervising:
            # The supervisor's next pass reports it, with every other end noticed by then, in one request
            # (many stops together: a cancelled array, a fence).
            self.sandbox_ended(t.handle.ref)
            return
        self._finish(t)

    def _checkpoint_then_wait(self, t: Tracked, signal: str, grace_s: float) -> None:
        """Send a checkpointing job its signal and give it up to ``grace_s`` to save and exit."""
        log.info("job %s attempt %s: %s, up to %ss to checkpoint", t.job_id, t.attempt, signal, grace_s)
        self.driver.signal(t.handle, signal)
        deadline = time.monotonic() + max(0.0, grace_s)
        while time.monotonic() < deadline and self.driver.poll(t.handle)[0] == RUNNING:
            time.sleep(0.1)

    def _terminal_for(self, t: Tracked, state: str, code: int | None) -> tuple[str, int | None, str]:
        if t.stop_state is not None:
            return t.stop_state, code, t.stop_reason
        if state == OOM:
            return "oom", code, "killed: the job exceeded its memory limit"
        if state == FENCED:
            t.lease_expired = True
            return "failed", code, "killed on the node: its lease ran out (the agent did not renew it in time)"
        if code == 0:
            return "succeeded", 0, ""
        if code is None:
            return "failed", None, "the sandbox disappeared; exit code unknown"
        return "failed", code, f"exited with code {code}"

    def _finish(self, t: Tracked) -> bool:
        """Flush the log tail, report the terminal state, remove the sandbox.
        Safe to call again: returns False (and keeps the job) until it is done."""
        if not t.lock.acquire(blocking=False):
            return False  # another thread is finishing it
        try:
            if t.key not in self._jobs:
                return True
            report = self._end_report(t)
            if report is None:
                return False
            if self._carries_running(t):
                self._report_batch([(t, report)])
                return t.key not in self._jobs
            return self._send_one(t, report)
        finally:
            t.lock.release()

    def _finish_many(self, ts: list[Tracked]) -> None:
        """``_finish`` for several jobs that ended together: their reports go up in batches of
        ``EVENTS_MAX`` (protocol 1.2), one request each, instead of one request a job. A portal that
        does not take batches (before 1.2: 404), or refuses one (400: some report in it is bad), gets
        them one by one, where each report's own refusal handling applies."""
        if len(ts) < 2 or not self.batch_events or not hasattr(self.client, "event_batch"):
            for t in ts:
                self._guarded(t, "terminal report", self._finish, t)
            return
        held = [t for t in ts if t.lock.acquire(blocking=False)]  # the others: another thread finishes them
        try:
            ready = []
            for t in held:
                if t.key not in self._jobs:
                    continue
                report = self._guarded(t, "end of job", self._end_report, t)
                if report is not None:
                    ready.append((t, report))
            chunk, size = [], 0
            for t, report in ready:  # at most EVENTS_MAX reports a request, a carried `running` counted
                need = 2 if self._carries_running(t) else 1
                if size + need > EVENTS_MAX:
                    self._report_batch(chunk)
                    chunk, size = [], 0
                chunk.append((t, report))
                size += need
            if chunk:
                self._report_batch(chunk)
        finally:
            for t in held:
                t.lock.release()

    def _report_batch(self, batch: list[tuple[Tracked, dict]]) -> None:
        """Send prepared end reports in one request, each after its job's `running` report where that is
        still to go (_take_running); each job's locks are held by the caller."""
        items, ends, carried, ready = [], [], [], []
        for t, report in batch:
            running = self._take_running(t)
            if running is None:
                continue  # its `running` is on its way: the end follows it
            if running:
                carried.append(t)
                items.append({"job_id": t.job_id, "attempt": t.attempt, "state": "running"})
            ends.append(len(items))
            items.append({"job_id": t.job_id, "attempt": t.attempt, **report})
            ready.append((t, report))
        if not ready:
            return
        batch = ready
        try:
            results = self.client.event_batch(items)
            if len(results) == len(items):
                results = [results[i] for i in ends]
        except PortalUnreachable:
            for t in carried:
                t.running_due = True  # it goes with the end again next pass
            return  # all kept: the next pass sends them again (each report is idempotent)
        except PortalError as exc:
            if exc.status in (404, 405):
                log.info("the portal takes no batched reports (agent protocol before 1.2); sending them one by one")
                self.batch_events = False
            for t, report in batch:
                self._guarded(t, "terminal report", self._send_one, t, report)
            return
        if len(results) != len(batch):
            log.error("the portal answered %d results to %d batched reports; sending them one by one",
                      len(results), len(batch))
            for t, report in batch:
                self._guarded(t, "terminal report", self._send_one, t, report)
            return
        for (t, report), res in zip(batch, results):
            self._guarded(t, "terminal report", self._reported, t, report, res.get("result") or "applied")

    def _send_one(self, t: Tracked, report: dict) -> bool:
        """Send one prepared end report on its own; True once the job is done here."""
        try:
            self.client.event(t.job_id, t.attempt, report["state"],
                              **{k: v for k, v in report.items() if k != "state"})
        except StaleAttempt:
            return self._reported(t, report, "stale")
        except PortalUnreachable:
            return False
        except PortalError as exc:
            return self._reported(t, report, exc)
        return self._reported(t, report, "applied")

    def _reported(self, t: Tracked, report: dict, outcome) -> bool:
        """What the portal made of ``t``'s end report: "applied" or "duplicate" (taken), "stale" (it
        moved on: the report is dropped) or a PortalError (refused: sent shorter next pass). Once taken
        or stale, the sandbox goes. Returns True when the job is done here."""
        state, code, message = report["state"], report["exit_code"], report["message"]
        if isinstance(outcome, PortalError):
            t.report_refusals += 1
            log.error("job %s attempt %s: the portal refused the %s report (%s); sending it shorter next pass",
                      t.job_id, t.attempt, state, outcome)
            return False
        if outcome == "stale":
            log.info("job %s attempt %s: portal says stale; dropping the %s report", t.job_id, t.attempt, state)
        else:
            log.info("job %s attempt %s: %s (exit %s) %s", t.job_id, t.attempt, state, code, message)
        self.driver.remove(t.handle)
        with self._lock:
            self._jobs.pop(t.key, None)
        if self.datasets is not None:  # its datasets may be evicted again
            self.datasets.release(f"{t.job_id}:{t.attempt}")
        return True

    def _end_report(self, t: Tracked) -> dict | None:
        """Everything before ``t``'s end report: its log tail, its outputs, the scrub of its GPUs.
        Returns the report's keyword arguments (``PortalClient.event``), or None while something of it
        must wait for a later pass. Call with ``t.lock`` held."""
        state, code, message = t.terminal
        try:
            if not self._ship_logs(t, final=True):
                return None  # a chunk was refused: try again next pass (a few times, then it is skipped)
        except StaleAttempt:
            pass  # the portal will not take more of this attempt; still report below
        except PortalUnreachable:
            # The tail first, but not at any price: a portal that takes reports and not logs
            # would otherwise keep the job running there for good.
            t.log_failures += 1
            if t.log_failures < LOG_REFUSALS:
                return None
            log.error("job %s attempt %s: the log tail could not be shipped %d times; reporting the end "
                      "without it", t.job_id, t.attempt, t.log_failures)
        if not self._outputs_uploaded(t):
            return None  # its upload runs (or waits for the portal): the report follows it
        if t.outputs_note:
            message = f"{message}; {t.outputs_note}" if message else t.outputs_note
        self._set_busy(t.handle.gpu_indexes, False)
        failures = self._scrub(t)
        if t.report_refusals:
            # The portal refused the full report; a report it can take beats none: the job
            # would stay running there, holding its GPUs and quota.
            code, message = None, f"(report shortened: the portal refused it {t.report_refusals} time(s))"
        return {"state": state, "exit_code": code, "message": message, "scrub_failures": failures,
                "node_problem": t.node_problem, "lease_expired": t.lease_expired}

    def _outputs_uploaded(self, t: Tracked) -> bool:
        """Whether the attempt's outputs (agents/artifacts.py) are uploaded, or given up. The upload runs
        on a thread of its own (a large one must not hold up other jobs' supervision); each call until
        it is done starts it again if it is not running."""
        if t.outputs_note is not None:
            return True
        folder = getattr(self.driver, "outputs_dir", lambda handle: None)(t.handle)
        if not folder:
            t.outputs_note = ""
            return True
        if not t.outputs.sent and artifacts.empty(folder):  # most jobs: no thread, no wait for the next tick
            t.outputs_note = ""
            return True
        if not self.background:
            self._upload_outputs(t, folder)
            return t.outputs_note is not None
        with self._lock:
            if t.outputs_thread is None or not t.outputs_thread.is_alive():
                t.outputs_thread = threading.Thread(target=self._upload_outputs, args=(t, folder), daemon=True,
                                                    name=f"outputs-{t.job_id}-{t.attempt}")
                t.outputs_thread.start()
        return False

    def _upload_outputs(self, t: Tracked, folder: str) -> None:
        try:
            t.outputs_note = artifacts.upload(self.client, t.job_id, t.attempt, folder, t.outputs)
        except PortalUnreachable as exc:
            t.outputs_failures += 1
            if t.outputs_failures >= LOG_REFUSALS:
                log.error("job %s attempt %s: outputs not uploaded, the portal was unreachable %d times: %s",
                          t.job_id, t.attempt, t.outputs_failures, exc)
                t.outputs_note = f"outputs: {len(t.outputs.sent)} file(s) uploaded, then the portal was unreachable"
        except Exception as exc:  # a bug here must not keep the job from ever being reported
            log.exception("job %s attempt %s: outputs upload failed", t.job_id, t.attempt)
            t.outputs_note = f"outputs: upload failed ({type(exc).__name__}: {exc})"

    def _scrub(self, t: Tracked) -> list[dict]:
        """Clear the GPUs this job leaves (once, however often its report is retried).
        A GPU shared with a job still running is left to the last one out."""
        if t.scrub_failures is None and t.node_problem:
            # Its processes may still compute on these GPUs: nothing to scrub, nothing to hand on.
            t.scrub_failures = _failure_list({i: "held by a sandbox that could not be killed"
                                              for i in t.handle.gpu_indexes})
        if t.scrub_failures is None:
            with self._lock:
                claimed = self._claim_locked(t.handle.gpu_indexes, t.key)
            t.scrub_failures = _failure_list(self._scrub_gpus(claimed, job=t.job_id))
        return t.scrub_failures

    def _scrub_gpus(self, indexes: list[int], job: str = "") -> dict[int, str]:
        """Scrub GPUs claimed by ``_claim_locked`` through the probe, then release them; the clean
        ones are no longer dirty."""
        if not (self.scrub_gpus and indexes and hasattr(self.probe, "scrub")):
            with self._lock:
                self._scrubbing -= set(indexes)
            return {}
        t0 = self._clock()
        try:
            failed = self.probe.scrub(indexes)
        except Exception as exc:  # a probe bug must not lose the job's report
            log.exception("GPU scrub of %s crashed", indexes)
            failed = {i: f"memory scrub crashed: {exc}" for i in indexes}
        with self._lock:
            self._dirty -= set(indexes) - set(failed)
            self._scrubbing -= set(indexes)
        for i, why in sorted(failed.items()):
            log.error("GPU %s (job %s): %s; the portal will take it out of service", i, job or "-", why)
        log.info("scrubbed GPU(s) %s in %.2fs%s", [i for i in indexes if i not in failed], self._clock() - t0,
                 f" after job {job}" if job else "")
        return failed

    # -- supervisor -----------------------------------------------------------------

    def supervise_once(self, only: set[str] | None = None) -> None:
        """One pass over every sandbox (or over those whose ``handle.ref`` is in ``only``): enforce
        time limits, notice exits, ship logs, report ends; then the lease. Each step is guarded on its
        own, so nothing that goes wrong in one (a report the portal refuses, a driver error) skips
        another step, another job, or the lease check."""
        with self._lock:
            jobs = [t for t in self._jobs.values() if only is None or t.handle.ref in only]
        ended = [t for t in jobs if self._supervise(t)]
        # 3. Report the ends (after their log tails), several in one request when many ended together.
        self._guarded(None, "end reports", self._finish_many, ended)
        self._guarded(None, "lease check", self.check_lease)

    def sandbox_ended(self, ref: str | None = None) -> None:
        """A driver saw the sandbox ``ref`` end: its supervision (exit, log tail, report) runs now.
        Called from the driver's watcher thread; many ends together make one pass."""
        with self._lock:
            self._ended.add(ref)
            if self.running_hold_s > 0:  # a launch holding its `running` report learns of the end at once
                for t in self._jobs.values():
                    if t.handle.ref == ref:
                        t.exited.set()
        self._wake.set()

    def _supervise(self, t: Tracked) -> bool:
        """Steps 1 and 2 for one sandbox; True when it has ended and its end is to be reported."""
        # 1. Enforcement first, from the handle and the clock alone: no report can get in its way.
        self._guarded(t, "time limit", self._enforce_time_limit, t)
        # 2. Notice an exit; ship the log of a running job.
        if t.terminal is None and t.stop_state is None:
            polled = self._guarded(t, "poll", self.driver.poll, t.handle)
            if polled is not None and polled[0] != RUNNING:
                with self._lock:
                    t.terminal = self._terminal_for(t, *polled)
            elif polled is not None:
                self._guarded(t, "log shipping", self._ship_running_logs, t)
        return t.terminal is not None

    def _guarded(self, t: Tracked | None, what: str, fn, *args):
        """``fn(*args)``, or None after logging whatever it raised."""
        try:
            return fn(*args)
        except Exception:
            log.exception("%s: %s failed; the rest of the pass goes on",
                          f"job {t.job_id} attempt {t.attempt}" if t else "supervisor", what)
            return None

    def _enforce_time_limit(self, t: Tracked) -> None:
        limit = t.handle.time_limit_s
        if (t.checkpoint and not t.warned and t.terminal is None and t.stop_state is None and limit
                and self._wall() >= t.handle.started_at + limit - t.checkpoint[1] and hasattr(self.driver, "signal")):
            # Slurm's --signal: the job hears its time is nearly up while it can still save.
            t.warned = True
            log.info("job %s attempt %s: %s, %gs before its time limit", t.job_id, t.attempt, *t.checkpoint)
            self.driver.signal(t.handle, t.checkpoint[0])
        if t.terminal is None and t.stop_state is None and limit and self._wall() >= t.handle.started_at + limit:
            try:
                ended = self.driver.poll(t.handle)[0] != RUNNING
            except Exception:  # a driver that cannot poll must not keep the limit from holding
                ended = False
            if ended:
                return  # it ended by itself (while the agent was down, say): its own exit is reported next
            self._begin_stop(t, "timeout", f"time limit of {limit:g}s reached", self.stop_grace_s)

    def _ship_running_logs(self, t: Tracked) -> None:
        try:
            self._ship_logs(t, final=False)
        except StaleAttempt:
            self._begin_stop(t, "cancelled", "stale attempt", self.stop_grace_s)
        except PortalUnreachable:
            pass  # the offset stays; next pass resends from there

    def _ship_logs(self, t: Tracked, *, final: bool) -> bool:
        """Send the sandbox's output from ``t.log_offset`` on, in chunks of raw bytes. A running job
        ships at most ``log_pass_bytes`` a pass (the rest next pass); at the end, everything.
        Returns False when the portal refused a chunk (kept for the next pass; after
        ``LOG_REFUSALS`` refusals in a row it is skipped, so one bad chunk cannot stall the log).
        Raises StaleAttempt and PortalUnreachable."""
        budget = None if final else self.log_pass_bytes
        while not t.log_full and (budget is None or budget > 0):
            try:
                data = self.driver.read_logs(t.handle, t.log_offset)
            except Exception:
                t.log_failures += 1
                if final and t.log_failures >= LOG_REFUSALS:
                    log.exception("job %s attempt %s: cannot read the log tail; reporting the end without it",
                                  t.job_id, t.attempt)
                    return True
                raise
            if not data:
                return True
            for i in range(0, len(data), self.log_chunk_bytes):
                chunk = data[i:i + self.log_chunk_bytes]
                try:
                    resp = self.client.logs(t.job_id, t.attempt, t.log_offset, chunk) or {}
                except (StaleAttempt, PortalUnreachable):
                    raise
                except PortalError as exc:
                    t.log_failures += 1
                    if t.log_failures < LOG_REFUSALS:
                        log.warning("job %s attempt %s: the portal refused %d log bytes at offset %d (%s); "
                                    "retrying next pass", t.job_id, t.attempt, len(chunk), t.log_offset, exc)
                        return False
                    log.error("job %s attempt %s: the portal refused %d log bytes at offset %d %d times (%s); "
                              "skipping them", t.job_id, t.attempt, len(chunk), t.log_offset, t.log_failures, exc)
                    resp = {}
                t.log_failures = 0
                t.log_offset += len(chunk)
                if resp.get("full"):
                    log.info("job %s attempt %s: the portal's log limit is reached; shipping no more of it",
                             t.job_id, t.attempt)
                    t.log_full = True
                    return True
            if budget is not None:
                budget -= len(data)
        return True

    # -- heartbeat and lease -------------------------------------------------------

    def heartbeat_once(self) -> dict | None:
        try:
            samples = [s.as_dict() for s in self.probe.sample()]
        except Exception:
            log.exception("GPU probe failed; heartbeat without samples")
            samples = []
        # An Xid seen in a sample whose heartbeat failed must not be lost.
        for s in samples:
            s["xid_errors"] = self._unsent_xids.pop(s["gpu_uuid"], []) + list(s["xid_errors"])
        with self._lock:
            jobs = [{"job_id": t.job_id, "attempt": t.attempt,
                     "state": t.terminal[0] if t.terminal else RUNNING} for t in self._jobs.values()]
            # Launches still in progress (confirming, waiting for GPUs, pulling): held here too, so the
            # portal neither re-places them nor takes them for lost (its reconciliation).
            jobs += [{"job_id": j, "attempt": a, "state": "starting"} for j, a in sorted(self._launching)
                     if (j, a) not in self._jobs]
        # The cached digests go up when they changed since the portal last took them (Node.cached_datasets).
        cached = self.datasets.digests() if self.datasets is not None else None
        changed = cached is not None and cached != self._datasets_sent
        try:
            resp = self.client.heartbeat(samples=samples, jobs=jobs, **({"cached_datasets": cached} if changed else {}))
        except PortalError as exc:
            for s in samples:
                if s["xid_errors"]:
                    self._unsent_xids.setdefault(s["gpu_uuid"], []).extend(s["xid_errors"])
            log.warning("heartbeat failed: %s", exc)
            self.write_lease()  # the portal's outage answer renews it too
            self.check_lease()
            return None
        self.write_lease()
        if changed:
            self._datasets_sent = cached
        if self.fenced:
            log.warning("portal reachable again after the lease ran out; resuming")
            self.fenced = False
        drain = bool(resp.get("drain"))
        if drain != self.drain:
            log.info("portal says drain=%s", drain)
        self.drain = drain
        for s in resp.get("stop") or ():
            self.stop(s["job_id"], s["attempt"], s.get("reason") or "stopped by the portal", s.get("grace_s"),
                      signal=s.get("signal"), wait=False)
        return resp

    def write_lease(self) -> None:
        """Write the lease's wall-clock deadline to the node's lease file, which the jobs' supervisors
        read (agents/supervisor/): they fence the jobs when the deadline passes, even with this agent
        dead or frozen. Drivers without such supervisors have no ``lease_path``."""
        path = getattr(self.driver, "lease_path", None)
        if path is None:
            return
        with self._lease_file_lock:  # one writer at a time, so a later renewal is never overwritten
            renewed = getattr(self.client, "lease_renewed_at", None)
            since = renewed if renewed is not None else self._started
            # Each launch asks for it (its supervisor reads the file from its start), but the deadline
            # moves only with a renewal: a node's launches of one pass write it (and fsync) once.
            wanted = (since, self.lease_s, self.fence_grace_s)
            if wanted == self._lease_written and os.path.exists(path):
                return
            try:
                write_lease(path, self._wall() + since + self.lease_s - self._clock(), self.fence_grace_s)
            except OSError as exc:  # the supervisors keep the last deadline they read: it only runs out
                log.error("could not write the lease file %s: %s", path, exc)
                return
            self._lease_written = wanted

    def check_lease(self) -> bool:
        """Stop every sandbox once the portal has been silent for longer than the
        lease (it may already be re-placing these jobs). Returns True if fenced.

        The lease runs from the sending of the last heartbeat the portal took (or
        of any request it answered with its outage 503: agents/client.py), not from
        log or event calls: the portal's reaper counts heartbeats only. A portal
        that is slow (a request unanswered while its host still accepts connections)
        renews it as its outage does, checked shortly before the deadline."""
        renewed = getattr(self.client, "lease_renewed_at", None)
        last = renewed if renewed is not None else self._started
        silent = self._clock() - last
        if not self.fenced and self.lease_s - min(SLOW_PROBE_AHEAD_S, self.lease_s / 3) < silent <= self.lease_s:
            # Before the deadline, not at it: a portal that is slow, not gone, renews the lease in time for
            # the lease file too (agents/client.py, renew_if_slow). Never past it: a lease that ran out (this
            # agent frozen through its probe window) is not revived, since the portal may have reaped the node.
            renew_if_slow = getattr(self.client, "renew_if_slow", None)
            if renew_if_slow is not None and renew_if_slow():
                silent = self._clock() - self.client.lease_renewed_at
        if self.fenced or silent <= self.lease_s:
            return self.fenced
        self.fenced = True
        with self._lock:
            live = [t for t in self._jobs.values() if t.terminal is None]
        log.error("LEASE EXPIRED: no answer from the portal for %.0fs (lease %.0fs); stopping all %d sandbox(es)",
                  silent, self.lease_s, len(live))
        for t in live:
            self._begin_stop(t, "failed", f"stopped by the agent: portal unreachable for {silent:.0f}s "
                             f"(lease {self.lease_s:g}s)", min(self.stop_grace_s, self.fence_grace_s),
                             lease_expired=True)
        return True

    # -- threads ----------------------------------------------------------------------

    def run_heartbeats(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.heartbeat_once()
            except Exception:
                log.exception("heartbeat loop error")
            stop.wait(self.heartbeat_interval_s)

    def run_supervisor(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """A full pass every ``interval_s``; in between, a pass over the sandboxes the driver saw end
        (``watch_exits``: process sandboxes by pidfd, docker by the engine's events), so an exit is
        reported within milliseconds rather than up to a tick later."""
        watch = getattr(self.driver, "watch_exits", None)
        if watch is not None:
            try:
                watch(self.sandbox_ended)
            except Exception:  # the ticks still notice every exit
                log.exception("watching sandbox exits failed; noticing them every %ss", interval_s)
        next_full = time.monotonic() + interval_s
        self._supervising = True
        try:
            self._supervise_loop(stop, interval_s, next_full)
        finally:
            self._supervising = False

    def _supervise_loop(self, stop: threading.Event, interval_s: float, next_full: float) -> None:
        while not stop.is_set():
            self._wake.wait(max(0.0, min(interval_s, next_full - time.monotonic())))
            if stop.is_set():
                break
            if self.end_gather_s > 0 and stop.wait(self.end_gather_s):
                break
            self._wake.clear()
            with self._lock:
                ended, self._ended = self._ended, set()
                tracked = {t.handle.ref for t in self._jobs.values()}
                now = time.monotonic()
                self._early_ends = {ref: seen for ref, seen in self._early_ends.items() if now - seen < 600}
                self._early_ends.update((ref, now) for ref in ended if ref is not None and ref not in tracked)
            try:
                if time.monotonic() >= next_full or None in ended:
                    self.supervise_once()
                    next_full = time.monotonic() + interval_s
                elif ended:
                    self.supervise_once(only=ended)
            except Exception:
                log.exception("supervisor loop error")

    def run_lease_checks(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        while not stop.wait(interval_s):
            self._guarded(None, "lease check", self.check_lease)

    def jobs(self) -> dict[Key, Tracked]:
        with self._lock:
            return dict(self._jobs)

    def join_stops(self, timeout: float = 30.0) -> None:
        """Wait for background stops (tests and shutdown)."""
        for th in list(self._stop_threads):
            th.join(timeout)

    def _set_busy(self, indexes, busy: bool) -> None:
        set_busy = getattr(self.probe, "set_busy", None)  # only simulated GPUs need telling
        if set_busy and indexes:
            set_busy(indexes, busy)


def _speaks(version, least: tuple[int, int]) -> bool:
    """Whether the portal's "MAJOR.MINOR" protocol version is at least ``least`` (None: before the field)."""
    try:
        major, minor = (int(x) for x in str(version).split(".", 1))
    except ValueError:
        return False
    return (major, minor) >= least


def _failure_list(failed: dict[int, str]) -> list[dict]:
    """Scrub failures as the agent API takes them."""
    return [{"gpu_index": i, "message": why[:500]} for i, why in sorted(failed.items())]


def capabilities(probe) -> dict:
    """What this node can enforce (and whether its GPUs are real). A GPU share (fractional job) is enforced only through CUDA MPS,
    which needs a real driver and the MPS control daemon; simulated GPUs never can."""
    import shutil

    return {"mps": probe.kind == "nvml" and shutil.which("nvidia-cuda-mps-control") is not None,
            # Jobs here see the GPU environment but no device: their pages say so.
            "simulated_gpus": probe.kind == "sim"}


def _memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0
