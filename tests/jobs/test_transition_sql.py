"""transition()'s UPDATE is compiled by the ORM once per shape (portal/jobs/states._update): every
later statement of that shape must be the ORM's own, SQL and parameters, and move only the job it
names, fenced by its states and attempt."""
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.db.models.sql import UpdateQuery
from django.utils import timezone

from portal.jobs import states
from portal.jobs.models import HOLDING, Job, JobState
from portal.jobs.states import transition
from tests.conftest import submit



@pytest.fixture(autouse=True)
def _needs_postgres(db):
    assert connection.vendor == "postgresql", "the compiled UPDATE is PostgreSQL's: set DATABASE_URL (make test does)"


def orm(job_id, from_states, attempt, values):
    query = states._moving(job_id, from_states, attempt).query.chain(UpdateQuery)
    query.add_update_values(values)
    sql, params = query.get_compiler("default").as_sql()
    return sql, list(params)


def shapes(now):
    """What the reports and the scheduler move jobs with, each twice with other values."""
    later = now + timedelta(seconds=7)
    for at in (now, later):
        yield [JobState.ASSIGNED], 0, {"state": JobState.STARTING, "state_changed_at": at}
        yield [JobState.STARTING, JobState.ASSIGNED], 3, {
            "state": JobState.RUNNING, "state_changed_at": at, "started_at": Coalesce(F("started_at"), Value(at))}
        yield list(HOLDING), 1, {"state": JobState.SUCCEEDED, "state_changed_at": at, "exit_code": 0,
                                 "ended_at": at, "queue_position": None}
        yield list(HOLDING), 2, {"state": JobState.FAILED, "state_changed_at": at, "exit_code": -9 if at == now else 3,
                                 "ended_at": at, "queue_position": None, "reason_code": "x", "reason_message": "y"}
        yield list(HOLDING), None, {"state": JobState.QUEUED, "state_changed_at": at, "node": None}


@pytest.mark.django_db
def test_every_compiled_update_is_the_orms(demo):
    now = timezone.now()
    for job_id in (7, 123456789):
        for from_states, attempt, values in shapes(now):
            for _ in range(2):  # compiled, then from the cache
                assert states._update(job_id, from_states, attempt, values) == orm(job_id, from_states, attempt, values)
    assert len(states._UPDATES) >= 5  # they were kept: the second of each came from the cache


@pytest.mark.django_db
def test_values_the_orm_converts_itself_are_not_kept(demo):
    job = submit(demo)
    node_update = {"state": JobState.QUEUED, "state_changed_at": timezone.now(), "avoid_nodes": {"n1": 1.0}}
    before = dict(states._UPDATES)
    assert states._update(job.pk, list(HOLDING), None, node_update)[1][2] is not None
    assert states._UPDATES == before  # JSON: compiled every time


@pytest.mark.django_db
def test_a_cached_update_moves_only_its_job_at_its_attempt(demo):
    a, b = submit(demo), submit(demo)
    Job.objects.filter(pk__in=[a.pk, b.pk]).update(state=JobState.STARTING, attempt=1)
    assert transition(a.pk, to=JobState.RUNNING, from_states=[JobState.STARTING], attempt=0) is False  # fenced
    assert transition(a.pk, to=JobState.RUNNING, from_states=[JobState.STARTING], attempt=1)
    first_start = Job.objects.get(pk=a.pk).started_at
    assert Job.objects.get(pk=b.pk).state == JobState.STARTING
    assert transition(b.pk, to=JobState.RUNNING, from_states=[JobState.STARTING], attempt=1)  # same shape, cached
    Job.objects.filter(pk=a.pk).update(state=JobState.STARTING)
    assert transition(a.pk, to=JobState.RUNNING, from_states=[JobState.STARTING], attempt=1)
    a_row, b_row = Job.objects.get(pk=a.pk), Job.objects.get(pk=b.pk)
    assert a_row.state == b_row.state == JobState.RUNNING
    assert a_row.started_at == first_start  # the first start is kept (the Coalesce)
    assert list(a_row.events.values_list("state", flat=True)).count(JobState.RUNNING) == 2
