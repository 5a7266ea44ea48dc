"""Services for what node agents report about jobs: confirm (fencing), state events, log chunks.

Every report carries (job_id, attempt) and comes from one node. A report for an attempt the
portal has moved past, or for a job that does not hold GPUs on that node, is stale: the
caller answers 409 and the agent stops that sandbox. Retries of a report already applied
are no-ops, so agents may retry freely.
"""
import logging
import threading
import time

from django.conf import settings
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import F, OuterRef, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from agents.protocol import TERMINAL_EVENT_STATES
from portal.core.errors import Conflict
from portal.core.numbers import parse_int, parse_ints
from portal.core.queue import SCHEDULE_PASS, request_schedule_pass, send
from portal.core.prepared import AnyOf, Prepared

from .models import HOLDING, TERMINAL, Allocation, Job, JobLogChunk, JobState
from .notifications import notifications_batched
from .node_effects import gpus_scrub_failed, job_requeue_after_node_fault, node_drain_for_fault, node_settle_drain
from .selectors import log_end, utf8_whole_len
from .states import start_many, transition

log = logging.getLogger(__name__)

# The states an agent's report ends an attempt with: the contract's (agents/protocol.py), as JobStates.
AGENT_TERMINAL = frozenset(JobState(s) for s in TERMINAL_EVENT_STATES)


def job_nodes(job: Job) -> set[str]:
    """The names of the nodes where `job` holds GPUs (or its node, for a CPU-only job)."""
    held = getattr(job, "held_on", None)  # read with the job by _load (PostgreSQL)
    if held is None:
        held = Allocation.objects.filter(job=job, released_at__isnull=True).values_list("gpu__node__name", flat=True)
    names = set(held)
    if not names and job.node_id:
        # A CPU-only job has no allocation, only its node (its name read with the job by _load).
        names = {getattr(job, "node_name", None) or job.node.name}
    return names


def _job_rows(jobs):
    """`jobs` as rows of the job's columns, its node's name and the nodes it holds GPUs on."""
    # PostgreSQL only: a portal on SQLite never loads django.contrib.postgres (nor psycopg).
    from django.contrib.postgres.expressions import ArraySubquery

    return jobs.order_by().values_list(*_JOB_COLUMNS, F("node__name"), ArraySubquery(Allocation.objects.filter(
        job=OuterRef("pk"), released_at__isnull=True).values("gpu__node__name")))


def _job_from_row(row) -> Job:
    *columns, node_name, held_on = row
    job = Job.from_db("default", _JOB_COLUMNS, columns)
    job.node_name, job.held_on = node_name, held_on
    return job


# _read's statements on PostgreSQL, compiled once per process (portal/core/prepared.py): every report
# reads its job this way, and building the statement (a join and a subquery) cost more CPU than
# running it, as did a RawQuerySet's mapping of its columns to fields.
_JOB_COLUMNS = [f.attname for f in Job._meta.concrete_fields]
_READ = Prepared(lambda pk: _job_rows(Job.objects.filter(pk=pk))[:1], pk=-(2**62))  # no job has that pk
_READ_MANY = Prepared(lambda ids: _job_rows(Job.objects.filter(AnyOf(F("pk"), ids))), ids=[])


def _read(pk: int) -> Job | None:
    """The job with its node's name (`node_name`) and, on PostgreSQL, the nodes it holds GPUs on
    (`held_on`): one query for what each report checks, or none for a job of a batch read before
    (`_prefetch`)."""
    if connection.vendor != "postgresql":
        return Job.objects.select_related("node").filter(pk=pk).first()
    read = getattr(_batch, "read", None)
    if read is not None and pk in read:
        return read.pop(pk)  # taken once: a second report of the job reads it anew, unless _read_again_as
    rows = _READ.rows(pk=pk)
    return _job_from_row(rows[0]) if rows else None


def _prefetch(events: list[dict], indexes: list[int]) -> dict | None:
    """The jobs of a batch's events, read in one statement for `_read`, or None where each is read
    when its turn comes: one event alone, or a batch with a report that may move other jobs
    (a GPU it could not scrub or a node problem drains the node, which migrates its
    checkpointing jobs). A job the statement does not find is None there, as `_read` would say."""
    if len(indexes) < 2 or connection.vendor != "postgresql" or any(
            events[i].get("scrub_failures") or events[i].get("node_problem") for i in indexes):
        return None
    ids = sorted({pk for i in indexes if (pk := parse_int(events[i]["job_id"])) is not None})
    if not ids:
        return None
    return dict.fromkeys(ids) | {job.pk: job for job in map(_job_from_row, _READ_MANY.rows(ids=ids))}


def _read_again_as(job: Job, **moved) -> None:
    """In a batch read at once (_prefetch): `job`, which this transaction just moved (and holds the
    row lock of), answers its next report in the batch as it is now, instead of a read (an agent
    sends a job's `running` and its end together when it ended at once)."""
    read = getattr(_batch, "read", None)
    if read is not None:
        for name, value in moved.items():
            setattr(job, name, value)
        read[job.pk] = job


def _ends_next(job: Job) -> bool:
    """Whether `job`'s report being applied is a `running` whose end comes next in this batch, and
    both may be written by one statement (`_running_then`)."""
    return (job.pk in (getattr(_batch, "ends_next", None) or ()) and connection.vendor == "postgresql"
            and job.array_parent_id is None and job.state in (JobState.ASSIGNED, JobState.STARTING))


def _running_then(job: Job, state: str, running_message: str, ends: dict) -> bool:
    """`job`'s `running` (deferred by job_report) and its end `state` in one transition, both
    events in its timeline (transition gives it a start with its `running`). False when the job
    moved since the batch read it (nothing written)."""
    return transition(job.pk, to=state, from_states={JobState.ASSIGNED, JobState.STARTING},
                      first_event=(JobState.RUNNING, running_message), **ends)


def _load(job_id, attempt: int, node, *, ended: bool = False) -> Job:
    """The job `job_id` at `attempt`, or Conflict (409, stale). With `ended` (the report ends that
    attempt), a checkpointing successor waiting for it may be scheduled now (_checkpoint_saved)."""
    pk = parse_int(job_id)
    job = _read(pk) if pk is not None else None
    if job is None:
        raise Conflict(f"No job {job_id}: stop it.", code="stale")
    if ended and job.attempt == attempt + 1 and job.resume_after is not None:
        _checkpoint_saved(pk, attempt)
    if job.attempt != attempt:
        raise Conflict(f"Job {job_id} is at attempt {job.attempt}, not {attempt}: stop it.", code="stale")
    return job


def held_job(*, node, job_id, attempt: int, states=HOLDING) -> Job:
    """The job whose ``attempt`` ``node`` holds in one of ``states``, or Conflict (409, stale)."""
    job = _load(job_id, attempt, node)
    if job.state not in states or node.name not in job_nodes(job):
        raise Conflict(f"Job {job_id} attempt {attempt} is {job.state} and not placed on {node.name}.", code="stale")
    return job


def job_confirm(*, node, job_id, attempt: int) -> Job:
    """The agent asks before starting anything: the job turns starting, or Conflict (409). The agent
    API answers with its launch spec (portal.launch, which composes it above jobs)."""
    job = held_job(node=node, job_id=job_id, attempt=attempt)
    starts = getattr(_batch, "starts", None)
    if starts is not None:  # a batch of confirmations: all written in one statement (job_confirm_many)
        starts[job.pk] = attempt
    else:
        transition(job.pk, to=JobState.STARTING, from_states={JobState.ASSIGNED}, attempt=attempt,
                   array_parent_id=job.array_parent_id, message=f"Confirmed by {node.name}")
    return job


def job_progress(*, node, job_id, attempt: int, stage: str, message: str) -> str:
    """What the node does for an attempt before it runs (agents.protocol.PROGRESS_STAGES: pulling its
    image), shown as the job's reason. Conflict (409) when the node no longer holds it starting."""
    job = held_job(node=node, job_id=job_id, attempt=attempt, states={JobState.ASSIGNED, JobState.STARTING})
    Job.objects.filter(pk=job.pk, attempt=attempt, state__in=[JobState.ASSIGNED, JobState.STARTING]).update(
        reason_code=stage, reason_message=message[:300])
    return "applied"


def job_report(*, node, job_id, attempt: int, state: str, exit_code: int | None = None, message: str = "",
               scrub_failures: list[dict] = (), node_problem: str = "", lease_expired: bool = False,
               not_startable: str = "") -> str:
    """Apply a state the agent reports. Returns what happened: applied, duplicate.

    A ``failed`` launch with ``not_startable`` never ran: the node lacked room it may have later (its
    dataset cache full of what running jobs read). The job goes back to the queue without counting
    a failure, kept off that node for SCHEDULER_NOT_STARTABLE_AVOID_S (requeue_not_startable).

    A ``failed`` end with ``lease_expired`` is the node's doing, not the job's: the node stopped
    the attempt because its lease ran out (its agent was cut off or frozen, and came back before
    the reaper's timeout). The job goes back to the queue as a new attempt, like a job the reaper
    takes from a silent node (docs/reliability.md F-05).

    GPUs the agent could not scrub are taken out of service, and a node whose sandbox could
    not be killed is drained, first, and even when the report itself is stale: the state of a
    GPU or a node does not depend on which attempt left it so.
    """
    if scrub_failures:
        gpus_scrub_failed(node=node, failures=scrub_failures, job_id=job_id)
    if node_problem:
        node_drain_for_fault(node=node, problem=node_problem)

    job = _load(job_id, attempt, node, ended=state in AGENT_TERMINAL)
    if job.state in TERMINAL:
        if job.state == state or state in AGENT_TERMINAL:
            return "duplicate"  # a retry, or the agent finishing a job the portal already ended
        raise Conflict(f"Job {job_id} already ended {job.state}.", code="stale")
    if job.state not in HOLDING or node.name not in job_nodes(job):
        raise Conflict(f"Job {job_id} attempt {attempt} is not running on {node.name}.", code="stale")
    if state == JobState.STARTING:
        transition(job.pk, to=JobState.STARTING, from_states={JobState.ASSIGNED}, attempt=attempt,
                   array_parent_id=job.array_parent_id)
        return "applied"
    if state == JobState.RUNNING:
        if job.state == JobState.RUNNING:
            return "duplicate"
        # The launch's progress ("pulling image ...") was its reason while it started: no longer.
        message = message or f"Running on {node.name}"
        if _ends_next(job):  # its end follows in this batch: one statement records both (_running_then)
            _read_again_as(job, running_first=message)
            return "applied"
        if transition(job.pk, to=JobState.RUNNING, from_states={JobState.ASSIGNED, JobState.STARTING},
                      attempt=attempt, array_parent_id=job.array_parent_id, message=message,
                      reason_code="", reason_message=""):
            _read_again_as(job, state=JobState.RUNNING)
        return "applied"
    if state == JobState.FAILED and node_problem and job.state in (JobState.ASSIGNED, JobState.STARTING):
        # It never ran: the node failed it (GPUs it could not free or scrub), not the job itself.
        if job_requeue_after_node_fault(job, f"Node {node.name} could not start it: {node_problem}"[:280]):
            _after_end(job)
        return "applied"
    if state == JobState.FAILED and not_startable and job.state in (JobState.ASSIGNED, JobState.STARTING):
        if requeue_not_startable(job, node.name, not_startable):
            _after_end(job)
            return "applied"
        return "duplicate"
    if state == JobState.FAILED and lease_expired:
        why = f"Node {node.name} stopped it when its lease ran out (its agent lost touch with the portal)."
        if job_requeue_after_node_fault(job, why):
            _after_end(job)
            return "applied"
        return "duplicate"
    if state in AGENT_TERMINAL:
        text = message or (f"Exit code {exit_code}" if exit_code is not None else state)
        more = {}
        if exit_code is not None or state in (JobState.SUCCEEDED, JobState.TIMEOUT, JobState.OOM):
            # It ran, though its `running` report never landed (lost, or overtaken by this one):
            # it started by its end at the latest, so pages and wait times have a start.
            now = timezone.now()
            more = {"ended_at": now, "started_at": Coalesce(F("started_at"), Value(now))}
        ends = dict(attempt=attempt, exit_code=exit_code, array_parent_id=job.array_parent_id, message=text,
                    reason_code="" if state == JobState.SUCCEEDED else state,
                    reason_message="" if state == JobState.SUCCEEDED else text[:300], **more)
        running_first = getattr(job, "running_first", None)
        if running_first is not None:
            if _running_then(job, state, running_first, ends):
                _after_end(job)
                return "applied"
            # It moved since the batch read it: the end as if sent apart (read again, checked again).
            return job_report(node=node, job_id=job_id, attempt=attempt, state=state, exit_code=exit_code,
                              message=message)
        done = transition(job.pk, to=state, from_states=HOLDING, **ends)
        if done:
            _after_end(job)
        return "applied" if done else "duplicate"
    raise Conflict(f"Unknown state {state!r}.", code="invalid_state")


def job_report_many(*, node, events: list[dict]) -> list[dict]:
    """Apply several reports of one node at once (protocol 1.2: many jobs ending together), in one
    transaction, each as ``job_report`` would alone: idempotent, fenced by its attempt, a stale one
    answered ``{"result": "stale"}`` (the 409 of a single report) without undoing the others.
    Returns one ``{"job_id", "result"[, "detail"]}`` per event, in order (``_in_id_order``)."""
    return _in_id_order(node, events, _report_one, "reports")


def job_confirm_many(*, node, confirms: list[dict]) -> list[dict]:
    """Confirm several launches of one node at once (protocol 1.7: a node's launches of one pass), in
    one transaction, each as ``job_confirm`` would alone. Returns one ``{"job_id", "result"[,
    "detail"]}`` per confirmation, in order: "confirmed", or "stale" (the 409 of a single confirm)."""
    return _in_id_order(node, confirms, _confirm_one, "confirmations")


def _in_id_order(node, items: list[dict], one, what: str) -> list[dict]:
    """``one(node, item)`` for each item in one transaction, in job id order, so two batches (or a
    batch and a scheduling pass, which also locks by id) take their row locks in one order. Should
    the database still pick this transaction as a deadlock's victim, nothing of it stays, and each
    item is applied again in a transaction of its own."""
    order = sorted(range(len(items)), key=lambda i: (parse_int(items[i]["job_id"]) or 0, i))
    with notifications_batched():
        try:
            with transaction.atomic():
                results = _apply(node, items, order, one)
        except OperationalError as exc:
            if getattr(exc, "__cause__", None) is None or type(exc.__cause__).__name__ != "DeadlockDetected":
                raise
            log.warning("node %s: a batch of %d %s lost a deadlock; applying them one by one", node.name,
                        len(items), what)
            results = {}
            for i in order:
                with transaction.atomic():
                    results.update(_apply(node, items, [i], one))
    return [results[i] for i in range(len(items))]


# The batch being applied (job_report_many): the nodes whose jobs ended in it (`ended_on`) and its
# jobs read at once and not yet taken (`read`, _prefetch); None outside one.
_batch = threading.local()


def _apply(node, events: list[dict], indexes: list[int], one) -> dict[int, dict]:
    """``one(node, events[i])`` for each of `indexes` in the caller's transaction; what each end asks
    for (a draining node settled, a scheduling pass) is done once for all of them (_after_end)."""
    _batch.ended_on = ended_on = set()
    try:
        _batch.read = _prefetch(events, indexes)
        _batch.ends_next = _running_then_ends(events, indexes) if _batch.read is not None else None
        # A batch's confirmations turn their jobs starting together (states.start_many).
        _batch.starts = {} if one is _confirm_one and _batch.read is not None else None
        results = {i: one(node, events[i]) for i in indexes}
        if _batch.starts:
            start_many(_batch.starts, message=f"Confirmed by {node.name}")
    finally:
        _batch.ended_on = _batch.read = _batch.ends_next = _batch.starts = None
    _ended(ended_on)
    return results


def _running_then_ends(events: list[dict], indexes: list[int]) -> set[int]:
    """The jobs whose `running` report is followed, next in `indexes`, by a plain end of the same
    attempt (an exit code and a message, nothing for the node): an agent whose job ended at once."""
    found = set()
    for i, j in zip(indexes, indexes[1:]):
        a, b = events[i], events[j]
        if (a.get("state") == JobState.RUNNING and b.get("state") in AGENT_TERMINAL
                and a["job_id"] == b["job_id"] and a.get("attempt") == b.get("attempt")
                and not any(b.get(k) for k in ("scrub_failures", "node_problem", "lease_expired", "not_startable"))
                and (pk := parse_int(a["job_id"])) is not None):
            found.add(pk)
    return found


def _report_one(node, event: dict) -> dict:
    # No savepoint: job_report refuses (Conflict) before it writes the job, and what it wrote before
    # that (GPUs it could not scrub, a node problem) stands, as for a single report.
    fields = {k: v for k, v in event.items() if k != "job_id"}
    try:
        return {"job_id": event["job_id"], "result": job_report(node=node, job_id=event["job_id"], **fields)}
    except Conflict as exc:
        return {"job_id": event["job_id"], "result": "stale", "detail": exc.message[:300]}


def _confirm_one(node, item: dict) -> dict:
    try:
        job_confirm(node=node, job_id=item["job_id"], attempt=item["attempt"])
    except Conflict as exc:  # raised before anything is written
        return {"job_id": item["job_id"], "result": "stale", "detail": exc.message[:300]}
    return {"job_id": item["job_id"], "result": "confirmed"}


def _checkpoint_saved(pk: int, attempt: int) -> None:
    """The end of an attempt that was stopped to checkpoint (states.requeue_holding): its successor
    may be scheduled now, not only once the grace has passed. Asked only when the job read says
    so (its next attempt waits with a resume time), so an ordinary end costs no query here."""
    if Job.objects.filter(pk=pk, attempt=attempt + 1, state=JobState.QUEUED,
                          resume_after__isnull=False).update(resume_after=None):
        request_schedule_pass()


def requeue_not_startable(job: Job, node_name: str, why: str) -> bool:
    """Send a job its node could not start back to the queue as a new attempt (its old attempt's
    reports turn stale), whatever JOB_MAX_ATTEMPTS says (nothing failed), with that node in its
    ``avoid_nodes`` until SCHEDULER_NOT_STARTABLE_AVOID_S from now. False when it no longer held the node."""
    now = time.time()
    until = now + settings.SCHEDULER_NOT_STARTABLE_AVOID_S
    avoid = {n: t for n, t in (job.avoid_nodes or {}).items() if isinstance(t, (int, float)) and t > now}
    avoid[node_name] = until
    why = why.rstrip(".")
    with transaction.atomic():
        if not transition(job.pk, to=JobState.QUEUED, from_states=HOLDING, attempt=job.attempt, node=None,
                          message=f"Not startable on {node_name}: {why}. Requeued as attempt {job.attempt + 1}."[:300],
                          reason_code="not_startable", avoid_nodes=avoid,
                          reason_message=(f"{why}; requeued for another node (not {node_name} for "
                                          f"{settings.SCHEDULER_NOT_STARTABLE_AVOID_S} s)")[:300]):
            return False
        Job.objects.filter(pk=job.pk).update(attempt=job.attempt + 1)
        # A pass when the node may be taken again (the job may have nowhere else to go; beat runs
        # one too, but not every deployment runs beat): the node is tried again then.
        transaction.on_commit(lambda: send(SCHEDULE_PASS, queue="scheduler",
                                           countdown=settings.SCHEDULER_NOT_STARTABLE_AVOID_S + 0.5))
    return True


def _after_end(job: Job) -> None:
    ended_on = getattr(_batch, "ended_on", None)
    if ended_on is not None:
        ended_on.add(job.node_id)  # settled once for the batch
    else:
        _ended({job.node_id})


def _ended(node_ids: set) -> None:
    """Jobs ended on `node_ids` (None: a job without a node): a draining node with nothing left
    becomes drained, and one scheduling pass is asked for, whatever the number of jobs."""
    if not node_ids:
        return
    for node_id in sorted(node_ids - {None}):
        node_settle_drain(node_id)
    request_schedule_pass()


def log_notice(cap: int) -> bytes:
    """What closes a log that reached the cap; part of the log, so every reader sees it."""
    size = f"{cap // 2**20} MiB" if cap % 2**20 == 0 else f"{cap} bytes"
    return (f"\n[gpuportal: log truncated: this attempt's log reached the portal's limit of {size} "
            f"(JOB_LOG_MAX_BYTES); later output was not kept]\n").encode()


def _insert_chunk(chunk: JobLogChunk) -> None:
    """chunk.save(force_insert=True) in plain SQL: Model.save's machinery (its signals, the INSERT
    compiled for each chunk) cost more CPU than the statement. The chunk gets no pk; no caller reads it."""
    names = ("job", "attempt", "offset", "data", "marker")
    columns = ", ".join(connection.ops.quote_name(JobLogChunk._meta.get_field(name).column) for name in names)
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {connection.ops.quote_name(JobLogChunk._meta.db_table)} ({columns}) "
                       f"VALUES (%s, %s, %s, %s, %s)",
                       [chunk.job_id, chunk.attempt, chunk.offset, bytes(chunk.data), chunk.marker])


def job_append_log(*, node, job_id, attempt: int, offset: int, data: bytes) -> dict:
    """Store a chunk of raw log bytes at its offset in the sandbox's output.

    Idempotent: bytes already stored are skipped, so a retried or re-shipped chunk (an agent
    restarted and sent the log again from 0) adds only what is new. Each attempt keeps the head
    of its log up to JOB_LOG_MAX_BYTES, the notice included, then nothing more.
    Returns {stored: any byte kept, size: bytes stored, full: the cap is reached}: a full log
    tells the agent to stop shipping this attempt.
    """
    job = _load(job_id, attempt, node)
    if node.name not in job_nodes(job) and job.node_id != node.pk:
        raise Conflict(f"Job {job_id} does not run on {node.name}.", code="stale")
    end, full = log_end(job, attempt=attempt)
    if full or offset + len(data) <= end:
        return {"stored": False, "size": end, "full": full}
    if offset < end:
        data, offset = data[end - offset:], end
    notice = log_notice(settings.JOB_LOG_MAX_BYTES)
    room = settings.JOB_LOG_MAX_BYTES - len(notice) - offset
    rows = [JobLogChunk(job=job, attempt=attempt, offset=offset, data=data)]
    if len(data) > room:  # this chunk crosses the cap: keep what fits, whole characters only
        head = data[:utf8_whole_len(data[:max(0, room)])]
        rows = [JobLogChunk(job=job, attempt=attempt, offset=offset, data=head)] if head else []
        # After a gap (bytes the agent could not ship) the chunk may start past the cap: the notice
        # still goes where the cap puts it, so no log ever ends beyond JOB_LOG_MAX_BYTES.
        at = min(offset + len(head), settings.JOB_LOG_MAX_BYTES - len(notice))
        rows.append(JobLogChunk(job=job, attempt=attempt, offset=at, data=notice, marker=True))
        log.info("job %s attempt %s: log reached JOB_LOG_MAX_BYTES; truncated", job.pk, attempt)
    try:
        if len(rows) == 1 and not connection.in_atomic_block:
            _insert_chunk(rows[0])  # one INSERT, no transaction around it: most chunks
        else:
            with transaction.atomic():
                JobLogChunk.objects.bulk_create(rows)
    except IntegrityError:  # the same chunk, sent twice at once: the other request stored it
        return {"stored": False, "size": log_end(job, attempt=attempt)[0], "full": full}
    last = rows[-1]
    return {"stored": True, "size": last.offset + len(last.data), "full": last.marker}


def stale_reports(*, node, reported: list[dict]) -> list[dict]:
    """Of the jobs an agent says it runs, those it must stop (cancelled, requeued, moved)."""
    keys = [(str(r.get("job_id")), int(r.get("attempt") or 0)) for r in reported
            if r.get("state") not in AGENT_TERMINAL]
    if not keys:
        return []  # an idle node's heartbeat: no query at all
    ids = parse_ints([j for j, _ in keys], limit=len(keys))
    current, saving = {}, {}
    for pk, state, job_attempt, signal, grace, resume_after in Job.objects.filter(pk__in=ids).values_list(
            "pk", "state", "attempt", "checkpoint_signal", "checkpoint_grace_s", "resume_after"):
        current[str(pk)] = (state, job_attempt)
        if signal and resume_after is not None:  # requeued to resume: its last attempt may save first
            saving[str(pk)] = (job_attempt - 1, {"signal": signal, "grace_s": grace})
    placed = {str(j) for j in Allocation.objects.filter(job_id__in=ids, released_at__isnull=True,
                                                       gpu__node=node).values_list("job_id", flat=True)}
    placed |= {str(j) for j in Job.objects.filter(pk__in=ids, node=node).values_list("pk", flat=True)}
    stops = []
    for job_id, attempt in keys:
        state, current_attempt = current.get(job_id, (None, None))
        if state is None:
            reason = "unknown job"
        elif current_attempt != attempt:
            reason = f"stale attempt (now {current_attempt})"
        elif state not in HOLDING:
            reason = f"job is {state}"
        elif job_id not in placed:
            reason = "not placed on this node"
        else:
            continue
        stop = {"job_id": job_id, "attempt": attempt, "reason": reason}
        if job_id in saving and saving[job_id][0] == attempt:
            stop.update(saving[job_id][1])
        stops.append(stop)
    return stops
