"""Reads compiled once (scheduler/prepared.py) return what the ORM returns for the same queryset,
with each call's placeholder values in place, and fall back to the ORM where the backend converts
a placeholder."""
import threading
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from portal.jobs.models import Job, JobState
from scheduler import adapter
from scheduler.prepared import Prepared
from tests.conftest import submit

EPOCH = adapter._NOW


def queued_after(since):
    return Job.objects.filter(state=JobState.QUEUED, submitted_at__gte=since).order_by("pk")


@pytest.mark.django_db
def test_rows_equal_the_orms_for_each_shape_and_placeholder_value(demo):
    jobs = [submit(demo, "alice", name=f"j{i}", resources={"gpus": 1}) for i in range(3)]
    Job.objects.filter(pk=jobs[0].pk).update(submitted_at=timezone.now() - timedelta(hours=2))
    shapes = {
        "values": lambda since: queued_after(since).values("id", "name", "env", **adapter.JOB_TIMES),
        "values_list": lambda since: queued_after(since).values_list("id", "cpus", adapter.Epoch("submitted_at")),
        "flat": lambda since: queued_after(since).values_list("id", flat=True),
    }
    for shape, build in shapes.items():
        prepared = Prepared(build, since=EPOCH)
        for since in (timezone.now() - timedelta(days=1), timezone.now() - timedelta(hours=1), timezone.now()):
            assert prepared.rows(since=since) == list(build(since)), (shape, since)
        assert prepared._local.compiled is not None, shape  # compiled once, then only run


@pytest.mark.django_db
def test_a_placeholder_the_backend_converts_is_read_through_the_orm(demo):
    job = submit(demo, "alice", name="named", resources={"gpus": 1})
    # A CharField turns the placeholder into its text: it cannot be found among the parameters.
    prepared = Prepared(lambda name: Job.objects.filter(name=name).values_list("pk", flat=True), name=123)
    assert prepared.rows(name="named") == [job.pk]
    assert prepared._local.compiled is None


@pytest.mark.django_db(transaction=True)
def test_each_thread_compiles_and_runs_on_its_own_connection(demo):
    job = submit(demo, "alice", name="threaded", resources={"gpus": 1})
    prepared = Prepared(lambda: Job.objects.filter(name="threaded").values_list("pk", flat=True))
    assert prepared.rows() == [job.pk]
    seen = []

    def read():
        try:
            seen.append((prepared.rows(), prepared._local.compiled[3].connection is connections["default"]))
        finally:
            connections.close_all()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert seen == [([job.pk], True)]
