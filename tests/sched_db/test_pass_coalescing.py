"""Passes coalesce (portal/core/passes.py): a burst of submits queues one pass until that pass
begins, a pass nobody requested (beat's) leaves the request to the pass it queued, the task waits
for a running pass instead of being dropped, and no notification task is queued for an end nobody
asked to hear about."""
import threading

import pytest
from django.core.cache import cache
from django.db import connections, transaction
from django.test import override_settings

from portal.accounts.models import NotificationPreference
from portal.core import locks, passes
from portal.core.context import Actor
from portal.jobs.models import HOLDING, Job, JobState
from portal.jobs.states import transition
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import submit as submit_job


@pytest.fixture
def published(monkeypatch):
    """What the portal queues (task name, countdown, task id), instead of the broker."""
    assert passes.shared_cache(), "these tests need the Redis cache: set REDIS_URL (make test does)"
    calls = []
    monkeypatch.setattr("portal.core.queue.app.send_task",
                        lambda name, args=(), queue=None, countdown=None, task_id=None, **kw:
                        calls.append((name, countdown, task_id)))
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    cache.delete(passes.FLAG)
    yield calls
    cache.delete(passes.FLAG)


def submit(demo, n, **over):
    for i in range(n):
        submit_job(demo, name=f"j{i}", **{"resources": {"gpus": 1}, **over})


def passes_queued(calls) -> list:
    return [countdown for name, countdown, _ in calls if name == "scheduler.schedule_pass"]


def queued_pass(calls) -> str:
    """The id of the one pass queued in `calls`, as the worker runs it."""
    (task_id,) = [task_id for name, _, task_id in calls if name == "scheduler.schedule_pass"]
    assert task_id
    return task_id


@pytest.mark.django_db(transaction=True)
def test_a_burst_of_submits_queues_one_pass_until_it_begins(demo, published):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    run_pass(task_id=queued_pass(published))  # the new node asked for one; it begins
    published.clear()
    submit(demo, 40)
    assert len(passes_queued(published)) == 1
    with override_settings(SCHEDULER_PASS_INTERVAL_S=60):
        result = run_pass(task_id=queued_pass(published))  # it begins: the next request queues the next pass
        assert result["started"] == 8 and result["queued"] == 40
        submit(demo, 20)
    (_, later) = passes_queued(published)
    # Passes start SCHEDULER_PASS_INTERVAL_S apart: the one queued right after a pass waits the rest.
    assert 50 < later <= 60


@pytest.mark.django_db(transaction=True)
def test_a_pass_nobody_requested_leaves_the_request_to_its_pass(demo, published):
    """Beat's pass (or a direct call) while a requested one waits: requests made after it still
    coalesce into the waiting pass, so beat never adds a second task that would keep re-queueing."""
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    requested = queued_pass(published)
    published.clear()
    for _ in range(3):
        run_pass(task_id="beat-" + requested)  # beat's, and others not requested
        submit(demo, 5)
        assert passes_queued(published) == []  # the requested pass will see them
    assert "skipped" not in run_pass(task_id=requested)
    submit(demo, 2)
    assert len(passes_queued(published)) == 1  # the requested pass began: the next is queued


@pytest.mark.django_db(transaction=True)
def test_a_request_whose_pass_was_lost_is_cleared_by_the_next_pass(demo, published, monkeypatch):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    queued_pass(published)  # never runs: its message was lost
    published.clear()
    run_pass()
    submit(demo, 1)
    assert passes_queued(published) == []  # not stale yet: it may still come
    monkeypatch.setattr(passes, "STALE_S", -1.0)  # now it is
    run_pass()
    submit(demo, 1)
    assert len(passes_queued(published)) == 1


@pytest.mark.django_db(transaction=True)
def test_without_the_shared_cache_every_request_queues_a_pass(demo, published):
    unreachable = {"default": {"BACKEND": "portal.core.cache.ResilientRedisCache",
                               "LOCATION": "redis://127.0.0.1:9/0", "OPTIONS": {"socket_connect_timeout": 0.2}}}
    with override_settings(CACHES=unreachable):
        submit(demo, 3)
    assert len(passes_queued(published)) == 3


@pytest.mark.django_db(transaction=True)
def test_the_pass_task_waits_for_a_running_pass_instead_of_dropping_its_request(demo, published):
    held, release, results = threading.Event(), threading.Event(), []

    def running_pass():
        try:
            with transaction.atomic():
                locks.xact_lock(locks.SCHEDULE_PASS)
                held.set()
                assert release.wait(30)
        finally:
            connections.close_all()

    other = threading.Thread(target=running_pass)
    other.start()
    assert held.wait(30)
    assert run_pass()["skipped"]  # a plain call returns at once, as before

    def task():
        try:
            results.append(run_pass(wait=True))
        finally:
            connections.close_all()

    waiting = threading.Thread(target=task)
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive() and not results  # it waits for the lock
    release.set()
    other.join(timeout=30)
    waiting.join(timeout=30)
    assert results and "skipped" not in results[0]


@pytest.mark.django_db(transaction=True)
def test_a_notification_task_is_queued_only_when_the_submitter_wants_the_mail(demo, published):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    submit(demo, 3)
    run_pass()
    jobs = list(Job.objects.filter(state__in=HOLDING).order_by("pk"))
    published.clear()
    # Defaults: success is not mailed, failure is.
    assert transition(jobs[0].pk, to=JobState.SUCCEEDED, from_states=HOLDING, attempt=jobs[0].attempt)
    assert transition(jobs[1].pk, to=JobState.FAILED, from_states=HOLDING, attempt=jobs[1].attempt)
    assert [name for name, *_ in published if name == "jobs.notify"] == ["jobs.notify"]
    NotificationPreference.objects.update_or_create(user=demo.users["alice"], defaults={"job_succeeded": True})
    published.clear()
    assert transition(jobs[2].pk, to=JobState.SUCCEEDED, from_states=HOLDING, attempt=jobs[2].attempt)
    assert [name for name, *_ in published if name == "jobs.notify"] == ["jobs.notify"]



@pytest.mark.django_db(transaction=True)
def test_a_last_start_that_is_not_a_number_does_not_fail_a_request(demo, published):
    """The last start is read outside the cache's serializer: a value in another form (here the
    serializer's pickled float) counts as none (a pass at once), not a 500."""
    cache.set(passes.LAST_START, 1.5e9, timeout=60)
    try:
        node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    finally:
        cache.delete(passes.LAST_START)
    assert passes_queued(published) == [None]  # published at once: no countdown


@pytest.mark.django_db(transaction=True)
def test_a_flag_in_another_form_is_cleared_by_the_next_pass(demo, published):
    """An older portal set the flag to "1": no pass names it, so the next pass clears it."""
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    cache.set(passes.FLAG, 1, timeout=60)
    published.clear()
    run_pass()
    submit(demo, 1)
    assert len(passes_queued(published)) == 1
