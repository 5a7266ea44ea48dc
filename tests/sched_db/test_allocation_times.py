"""Allocation intervals come from real times: on a whole GPU, one ends before the next begins,
so billed GPU time equals allocated time (reliability INV-2, INV-5)."""
import threading

import pytest
from django.db import connections

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job
from portal.jobs.reports import job_report
from portal.nodes.services import node_add
from scheduler import adapter
from tests.conftest import submit as submit_job

pytestmark = pytest.mark.django_db(transaction=True)


def submit(demo, name):
    return submit_job(demo, name=name, resources={"gpus": 1})


def test_the_next_allocation_of_a_gpu_starts_after_the_last_one_ended(demo, quiet, monkeypatch):
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    first = submit(demo, "first")
    adapter.run_pass()
    job_report(node=node, job_id=first.pk, attempt=1, state="running")
    second = submit(demo, "second")

    # The pass has begun (and read its clock) when the first job's exit, applied by another
    # process, commits: the pass then sees the GPU free and gives it to the second job.
    begin = adapter._cancel_failed_dependents

    def exit_lands_during_the_pass():
        def report():
            try:
                job_report(node=node, job_id=first.pk, attempt=1, state="succeeded", exit_code=0)
            finally:
                connections.close_all()

        t = threading.Thread(target=report)
        t.start()
        t.join(30)
        return begin()

    monkeypatch.setattr(adapter, "_cancel_failed_dependents", exit_lands_during_the_pass)
    adapter.run_pass()
    assert Job.objects.get(pk=first.pk).state == "succeeded"
    assert Job.objects.get(pk=second.pk).state == "assigned"
    ended = Allocation.objects.get(job=first).released_at
    began = Allocation.objects.get(job=second).started_at
    assert ended <= began, f"allocations overlap by {(ended - began).total_seconds():.6f}s"
