"""The las policy through the whole pass on PostgreSQL: the snapshot carries each job's attained
GPU-service from its earlier attempts' allocations, and a new job preempts the job that has had
more service."""
from datetime import timedelta

import pytest

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job
from portal.jobs.reports import job_report
from portal.nodes.services import node_add
from scheduler import adapter, core
from tests.conftest import submit as submit_job

pytestmark = pytest.mark.django_db(transaction=True)


def submit(demo, name, gpus):
    return submit_job(demo, name=name, resources={"gpus": gpus}, time_limit=86400)


def started_ago(job, seconds: float) -> None:
    """Move the open allocations of a running job back in time, as if it had run that long."""
    rows = Allocation.objects.filter(job=job, released_at__isnull=True)
    for a in rows:
        a.started_at -= timedelta(seconds=seconds)
        a.save(update_fields=["started_at"])


def test_attained_service_comes_from_earlier_attempts_and_las_preempts_by_it(demo, sent, settings):
    settings.SCHEDULER_POLICY = "las"
    settings.SCHEDULER_MIN_RUNTIME_S = 60
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    long = submit(demo, "long", 2)
    adapter.run_pass()
    job_report(node=node, job_id=long.pk, attempt=1, state="running")
    started_ago(long, 2 * 3600)  # 2 GPUs x 2 h = 4 GPU-hours: past the 1 GPU-hour threshold

    new = submit(demo, "new", 2)
    out = adapter.run_pass()
    assert out["preempted"] == 1
    long.refresh_from_db()
    assert long.state == "queued" and long.attempt == 2 and "least attained service" in long.reason_message

    snap, _ = adapter.build_snapshot()
    (queued_long,) = [j for j in snap.queued if j.id == str(long.pk)]
    assert queued_long.attained_gpu_s == pytest.approx(4 * 3600, abs=60)
    assert queued_long.queued_since == pytest.approx(long.state_changed_at.timestamp())
    # The GPUs are free once the old attempt's stop lands: the new job, in the first queue, goes first.
    plan = core.schedule(snap)
    assert [s.job_id for s in plan.starts] == [str(new.pk)]
    assert plan.waiting[str(long.pk)].position == 1
    assert Job.objects.get(pk=new.pk).state == "queued"
