"""The single way a job changes state: a conditional UPDATE whose row count says who won."""
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce
from django.db.models.sql import UpdateQuery
from django.utils import timezone

from .models import HOLDING, TERMINAL, Allocation, Job, JobEvent, JobState
from .notifications import notification_kind, notify_on_commit


_UNREAD = object()


def transition(job_id: int, *, to: str, from_states, attempt: int | None = None, message: str = "",
               array_parent_id=_UNREAD, first_event: tuple[str, str] | None = None, **fields) -> bool:
    """Move job `job_id` to `to` if it is in one of `from_states` (and at `attempt`, when given).

    One `UPDATE ... WHERE id=%s AND state IN (...) [AND attempt=%s]`; a row count of 0 means
    another actor moved the job first, and nothing else is written. On success the timeline
    gets its event, GPUs are released when the job leaves the holding states, and the
    submitter's email (end, preemption) is queued after commit. A terminal event is unique
    per job in the database, so a job can end only once.

    A caller that has read the job (an agent's report) passes `attempt` and `array_parent_id`
    (which never changes): the job is then not read again after its UPDATE.

    `first_event` (state, message): a step the job took on its way, recorded before this one in
    the same statement (an agent's `running` and its end in one batch: reports.job_report). Only
    on PostgreSQL, for a job that is not an array task.
    """
    now = timezone.now()
    values = {"state": to, "state_changed_at": now, **fields}
    if to in TERMINAL:
        values.setdefault("ended_at", now)
        values.setdefault("queue_position", None)
    if to == JobState.RUNNING or (first_event is not None and first_event[0] == JobState.RUNNING):
        # First start only: a requeued job keeps its original start for wait-time metrics.
        values.setdefault("started_at", Coalesce(F("started_at"), Value(now)))
    if connection.vendor == "postgresql" and (to in HOLDING or array_parent_id is None):
        # Not an array task (its parent is refreshed in the transaction below): the row, its event
        # and the release of its GPUs in one statement, atomic on its own, instead of a transaction.
        moved_attempt = _update_with_event(_update(job_id, from_states, attempt, values), to, message[:300], now,
                                           first_event)
        if moved_attempt is None:
            return False
        if kind := notification_kind(to, fields.get("reason_code", "")):
            notify_on_commit(job_id, moved_attempt, kind)
        return True
    assert first_event is None, "first_event: PostgreSQL, not an array task"
    with transaction.atomic():
        if _moving(job_id, from_states, attempt).update(**values) != 1:
            return False
        if attempt is None or array_parent_id is _UNREAD:
            row = Job.objects.values("attempt", "array_parent_id").get(pk=job_id)
        else:
            row = {"attempt": fields.get("attempt", attempt), "array_parent_id": array_parent_id}
        JobEvent.objects.create(job_id=job_id, attempt=row["attempt"], state=to, terminal=to in TERMINAL,
                                message=message[:300])
        kind = notification_kind(to, fields.get("reason_code", ""))
        if kind and not row["array_parent_id"]:  # an array mails once, when its parent ends
            notify_on_commit(job_id, row["attempt"], kind)
        if to not in HOLDING:
            Allocation.objects.filter(job_id=job_id, released_at__isnull=True).update(released_at=now)
        if to in TERMINAL and row["array_parent_id"]:
            refresh_array_parent(row["array_parent_id"])
    return True


def _moving(job_id: int, from_states, attempt: int | None):
    qs = Job.objects.filter(pk=job_id, state__in=list(from_states))
    return qs if attempt is None else qs.filter(attempt=attempt)


# transition()'s UPDATE statements by shape (the states it moves from, whether it names the attempt,
# the columns it sets and which are NULL or first-start only): compiling the ORM's UPDATE cost about
# as much CPU as running it, and an agent's report makes one.
_UPDATES: dict[tuple, str] = {}


def _update(job_id: int, from_states, attempt: int | None, values: dict) -> tuple[str, list]:
    """``_moving(...).update(**values)`` as SQL and parameters: compiled by the ORM once per shape.
    A shape is kept only when the parameters built here for it are the ORM's own, so a value the
    ORM would convert differently (JSON, a model) is compiled every time instead."""
    shape = (tuple(from_states), attempt is not None, tuple((name, _kind(value)) for name, value in values.items()))
    sql = _UPDATES.get(shape)
    if sql is not None:
        return sql, _update_params(job_id, from_states, attempt, values)
    qs = _moving(job_id, from_states, attempt)
    query = qs.query.chain(UpdateQuery)
    query.add_update_values(values)
    sql, params = query.get_compiler(qs.db).as_sql()
    if all(kind is not None for _, kind in shape[2]) and _update_params(job_id, from_states, attempt, values) == list(params):
        _UPDATES[shape] = sql
    return sql, list(params)


def _kind(value):
    """How `value` enters the UPDATE: a parameter, NULL (no parameter), the first-start Coalesce,
    or None (anything else: not kept)."""
    if value is None:
        return "null"
    if isinstance(value, Coalesce):
        first, second = value.get_source_expressions()
        if isinstance(first, F) and isinstance(second, Value):
            return f"coalesce:{first.name}"
        return None
    return None if hasattr(value, "resolve_expression") or hasattr(value, "prepare_database_save") else "value"


def _update_params(job_id: int, from_states, attempt: int | None, values: dict) -> list:
    params = []
    for name, value in values.items():
        if isinstance(value, Coalesce):
            params.append(value.get_source_expressions()[1].value)
        elif value is not None:
            params.append(Job._meta.get_field(name).get_db_prep_save(value, connection=connection))
    params += [int(job_id), *dict.fromkeys(from_states)]
    return params + ([int(attempt)] if attempt is not None else [])


def _update_with_event(update: tuple[str, list], to: str, message: str, now,
                       first_event: tuple[str, str] | None = None) -> int | None:
    """The job's UPDATE (`_update`) and, when it moved the job, its timeline event (after
    `first_event`'s, if given) and (leaving the holding states) the release of its GPUs, in one
    statement; the attempt it moved, or None."""
    sql, params = update
    first, first_params = "", []
    if first_event is not None:
        first = "SELECT id, attempt, %s, %s, %s, %s FROM moved UNION ALL "
        first_params = [first_event[0], first_event[0] in TERMINAL, first_event[1][:300], now]
    job, event, allocation = Job._meta.db_table, JobEvent._meta.db_table, Allocation._meta.db_table
    release = "" if to in HOLDING else (
        f", released AS (UPDATE {allocation} SET released_at = %s "
        f"WHERE job_id IN (SELECT id FROM moved) AND released_at IS NULL)")
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH moved AS ({sql} RETURNING {job}.id, {job}.attempt), "
            f"event AS (INSERT INTO {event} (job_id, attempt, state, terminal, message, at) "
            f"{first}SELECT id, attempt, %s, %s, %s, %s FROM moved){release} SELECT attempt FROM moved",
            [*params, *first_params, to, to in TERMINAL, message, now, *([now] if release else [])])
        row = cursor.fetchone()
    return row[0] if row else None


def assign_many(assignments: dict[int, tuple[int, str]], *, message_for) -> dict[int, int]:
    """`transition()` for many queued jobs at once (a pass that starts thousands).

    assignments: job id -> (node id, placement topology). One conditional UPDATE ... WHERE
    state='queued' from three arrays, RETURNING the ids that moved (a job cancelled meanwhile
    does not), then one insert of their events from arrays: a few parameters whatever the count,
    no model per row. Returns {job id: attempt} of the jobs that moved. PostgreSQL only; callers
    fall back to transition() elsewhere.
    """
    if not assignments:
        return {}
    now = timezone.now()
    nodes, topologies = zip(*assignments.values())
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {Job._meta.db_table} AS j SET state = %s, state_changed_at = %s, node_id = v.node, "
            f"placement_topology = v.topology, reason_code = '', reason_message = '', queue_position = NULL "
            f"FROM unnest(%s::bigint[], %s::bigint[], %s::text[]) AS v(id, node, topology) "
            f"WHERE j.id = v.id AND j.state = %s RETURNING j.id, j.attempt",
            [JobState.ASSIGNED, now, list(assignments), list(nodes), list(topologies), JobState.QUEUED])
        moved = dict(cursor.fetchall())
        if moved:
            cursor.execute(
                f"INSERT INTO {JobEvent._meta.db_table} (job_id, attempt, state, terminal, message, at) "
                f"SELECT v.job, v.attempt, %s, false, v.message, %s "
                f"FROM unnest(%s::bigint[], %s::integer[], %s::text[]) AS v(job, attempt, message)",
                [JobState.ASSIGNED, now, list(moved), list(moved.values()),
                 [message_for(job_id)[:300] for job_id in moved]])
    return moved


def start_many(attempts: dict[int, int], *, message: str) -> set[int]:
    """`transition(to=STARTING, from_states={ASSIGNED})` for several jobs of one node at once (its
    launches' confirmations): job id -> attempt, one statement for their UPDATE and their events.
    Returns the ids that moved (one moved or cancelled meanwhile does not). PostgreSQL only."""
    if not attempts:
        return set()
    now = timezone.now()
    job, event = Job._meta.db_table, JobEvent._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH moved AS (UPDATE {job} AS j SET state = %s, state_changed_at = %s "
            f"FROM unnest(%s::bigint[], %s::integer[]) AS v(id, attempt) "
            f"WHERE j.id = v.id AND j.attempt = v.attempt AND j.state = %s RETURNING j.id, j.attempt), "
            f"event AS (INSERT INTO {event} (job_id, attempt, state, terminal, message, at) "
            f"SELECT id, attempt, %s, false, %s, %s FROM moved) SELECT id FROM moved",
            [JobState.STARTING, now, list(attempts), list(attempts.values()), JobState.ASSIGNED,
             JobState.STARTING, message[:300], now])
        return {row[0] for row in cursor.fetchall()}


def allocate_whole_gpus(rows: list[tuple[int, int, int, bool, object]]) -> None:
    """Insert whole-GPU allocations (job id, attempt, GPU id, borrowed, started_at) in one
    statement from arrays (a pass that starts thousands). The partial unique index still refuses
    a GPU allocated twice: IntegrityError, as bulk_create would raise. PostgreSQL only."""
    if not rows:
        return
    jobs, attempts, gpus, borrowed, started = (list(c) for c in zip(*rows))
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Allocation._meta.db_table} "
            f"(job_id, attempt, gpu_id, fraction, shared, borrowed, started_at, released_at, tallied) "
            f"SELECT v.job, v.attempt, v.gpu, 1, false, v.borrowed, v.started, NULL, false "
            f"FROM unnest(%s::bigint[], %s::integer[], %s::bigint[], %s::boolean[], %s::timestamptz[]) "
            f"AS v(job, attempt, gpu, borrowed, started)",
            [jobs, attempts, gpus, borrowed, started])


def refresh_array_parent(parent_id: int) -> None:
    """An array parent mirrors its tasks: running while any runs, terminal when all are."""
    tasks = Job.objects.filter(array_parent_id=parent_id)
    states = set(tasks.values_list("state", flat=True))
    if not states:
        return
    if states <= TERMINAL:
        if states == {JobState.SUCCEEDED}:
            final = JobState.SUCCEEDED
        elif JobState.CANCELLED in states and not states & {JobState.FAILED, JobState.TIMEOUT, JobState.OOM,
                                                             JobState.NODE_FAIL}:
            final = JobState.CANCELLED
        else:
            final = JobState.FAILED
        done = tasks.filter(state=JobState.SUCCEEDED).count()
        transition(parent_id, to=final, from_states=set(JobState.values) - TERMINAL,
                   message=f"{done} of {tasks.count()} tasks succeeded")
    elif states & {JobState.ASSIGNED, JobState.STARTING, JobState.RUNNING}:
        Job.objects.filter(Q(pk=parent_id), state=JobState.QUEUED).update(state=JobState.RUNNING,
                                                                        state_changed_at=timezone.now())


def stop_args(signal: str, grace_s: int | None) -> tuple[int, str | None]:
    """(grace, signal) of the `agent.stop` that ends a job's attempt to move it: a checkpointing
    job gets its own signal and grace to save; any other SIGTERM and PREEMPT_GRACE_S."""
    if signal:
        return int(grace_s or 0), signal
    return settings.PREEMPT_GRACE_S, None


def requeue_holding(job_id: int, *, attempt: int, reason_code: str, message: str, reason_message: str = "",
                    via: str | None = None) -> list[tuple[str, int, int, int, str | None]] | None:
    """Send a job that holds GPUs back to the queue as its next attempt (preemption, migration,
    a drain, a GPU fault), in the caller's transaction. `via` is a state it passes through first
    (`preempted`). Returns the stops to send after commit, (node, job, old attempt, grace,
    signal) per node it held, or None when the job was no longer holding at `attempt`.

    A checkpointing job is not scheduled again before its old attempt has stopped: `resume_after`
    is set to its grace plus PREEMPT_GRACE_S from now and cleared as soon as the old attempt's
    end is reported (reports.job_report), so two attempts never write one checkpoint folder."""
    row = Job.objects.filter(pk=job_id).values("checkpoint_signal", "checkpoint_grace_s", "node__name").first()
    if row is None:
        return None
    nodes = sorted(set(Allocation.objects.filter(job_id=job_id, released_at__isnull=True)
                       .values_list("gpu__node__name", flat=True))) or [n for n in [row["node__name"]] if n]
    grace, signal = stop_args(row["checkpoint_signal"], row["checkpoint_grace_s"])
    resume_after = None
    note = reason_message or message
    if signal:
        resume_after = timezone.now() + timedelta(seconds=grace + settings.PREEMPT_GRACE_S)
        note = (f"{note} It got {signal} and {grace} s to checkpoint; attempt {attempt + 1} resumes from its "
                f"checkpoint once attempt {attempt} has stopped.")
    with transaction.atomic():
        if via is not None:
            if not transition(job_id, to=via, from_states=HOLDING, attempt=attempt, message=message):
                return None
            came_from = {via}
        else:
            came_from = HOLDING
        if not transition(job_id, to=JobState.QUEUED, from_states=came_from, attempt=attempt, node=None,
                          message=f"{message} Requeued as attempt {attempt + 1}."[:300], reason_code=reason_code,
                          reason_message=note[:300], resume_after=resume_after):
            return None
        Job.objects.filter(pk=job_id).update(attempt=attempt + 1)
    return [(name, job_id, attempt, grace, signal) for name in nodes]
