"""Idle detection: running jobs whose GPUs all stayed under GPU_IDLE_UTIL_PCT for GPU_IDLE_MINUTES."""
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import HOLDING, Allocation, Job, JobEvent, JobState
from portal.jobs.services import job_submit
from portal.metrics.services import jobs_flag_idle
from portal.jobs.states import transition
from portal.metrics.services import rollup_minutes, samples_write
from portal.nodes.services import node_add
from portal.tenancy.models import Quota
from scheduler.adapter import run_pass

# Samples, rollups and ages in minutes: every instant of --clock-instants (tests/clock.py).
pytestmark = [pytest.mark.clock, pytest.mark.usefixtures("passes_here")]  # the tests run passes


@pytest.fixture
def cluster(clock, demo, sent):
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="4xH100-80GB")
    demo.gpus = list(node.gpus.order_by("index"))
    return demo


def running(demo, gpus=1, minutes_ago=60, user="alice"):
    job, _ = job_submit(actor=Actor(user=demo.users[user]), data={
        "project": "vision", "name": "notebook", "image": "gpuportal/busybox:latest", "command": ["sleep", "1d"],
        "resources": {"gpus": gpus}})
    run_pass()
    assert transition(job.pk, to=JobState.RUNNING, from_states=HOLDING)
    Allocation.objects.filter(job=job).update(started_at=timezone.now() - timedelta(minutes=minutes_ago))
    return Job.objects.get(pk=job.pk)


def utilization(job_or_gpus, util, minutes=40, now=None):
    """Samples every minute of the last `minutes` for the GPUs, rolled up as the beat task would."""
    now = now or timezone.now()
    gpu_ids = (list(Allocation.objects.filter(job=job_or_gpus, released_at__isnull=True).values_list("gpu_id",
                                                                                                      flat=True))
               if isinstance(job_or_gpus, Job) else job_or_gpus)
    samples_write([(g, now - timedelta(minutes=m, seconds=-1), float(util), 100, 81920, 50.0, 100.0, 0, [])
                   for m in range(1, minutes + 1) for g in gpu_ids])
    rollup_minutes(now=now, lookback_minutes=minutes + 2)


def test_idle_job_is_flagged_once_and_shown(cluster, api, client):
    job = running(cluster)
    utilization(job, 0.5)
    assert jobs_flag_idle()["flagged"] == 1
    job.refresh_from_db()
    assert job.idle_since is not None and job.state == "running"
    assert JobEvent.objects.filter(job=job, message__startswith="Flagged idle").count() == 1
    # Flagged once however often the task runs.
    assert jobs_flag_idle()["flagged"] == 0
    assert Job.objects.get(pk=job.pk).idle_since == job.idle_since

    assert api("alice").get(f"/api/v1/jobs/{job.pk}/").json()["idle_since"] is not None
    assert api("alice").get("/api/v1/jobs/").json()["results"][0]["idle_since"] is not None
    client.force_login(cluster.users["alice"])
    assert 'id="job-idle"' in client.get(f"/jobs/{job.pk}/").content.decode()
    client.force_login(cluster.users["admin"])
    html = client.get("/console/").content.decode()
    assert job.idle_since.strftime("%Y-%m-%d %H:%M") in html


def test_busy_job_is_not_flagged(cluster):
    job = running(cluster)
    utilization(job, 60)
    assert jobs_flag_idle()["flagged"] == 0


def test_one_busy_gpu_keeps_the_job_unflagged(cluster):
    job = running(cluster, gpus=2)
    first, second = Allocation.objects.filter(job=job).values_list("gpu_id", flat=True)
    utilization([first], 0)
    utilization([second], 90)
    assert jobs_flag_idle()["flagged"] == 0


def test_no_samples_is_no_evidence(cluster):
    running(cluster)
    assert jobs_flag_idle() == {"idle": 0, "flagged": 0, "unflagged": 0, "cancelled": 0}


def test_young_job_is_not_flagged(cluster, settings):
    job = running(cluster, minutes_ago=settings.GPU_IDLE_MINUTES - 5)
    utilization(job, 0)
    assert jobs_flag_idle()["flagged"] == 0


def test_flag_is_cleared_when_the_gpus_work_again(cluster):
    job = running(cluster)
    utilization(job, 0)
    jobs_flag_idle()
    utilization(job, 70, minutes=3)
    assert jobs_flag_idle()["unflagged"] == 1
    assert Job.objects.get(pk=job.pk).idle_since is None


def test_project_setting_cancels_idle_jobs(cluster, sent, django_capture_on_commit_callbacks):
    Quota.objects.filter(project=cluster.vision).update(idle_auto_cancel=True)
    job = running(cluster)
    utilization(job, 0)
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_flag_idle()["cancelled"] == 1
    job.refresh_from_db()
    assert job.state == "cancelled" and job.idle_since is not None
    assert job.reason_message.startswith("Cancelled as idle: its GPUs stayed under 5% utilization for 30 minutes")
    assert ("agent.stop", "gpu-01", [str(job.pk), 1, "cancelled", 30]) in sent
    # An ended job keeps its flag (why it was cancelled); the next run leaves it alone.
    assert jobs_flag_idle()["unflagged"] == 0


def test_setting_is_off_by_default_and_editable_by_staff(cluster, api):
    assert api("alice").get("/api/v1/projects/vision/quota/").json()["idle_auto_cancel"] is False
    r = api("admin").patch("/api/v1/projects/vision/quota/", data={"idle_auto_cancel": True}, format="json")
    assert r.status_code == 200 and r.json()["idle_auto_cancel"] is True
    assert Quota.objects.get(project=cluster.vision).idle_auto_cancel


def test_beat_runs_it_on_the_scheduler_queue():
    from portal.celery import app

    (entry,) = [e for e in app.conf.beat_schedule.values() if e["task"] == "metrics.flag_idle_jobs"]
    assert entry["options"]["queue"] == "scheduler"
    app.loader.import_default_modules()  # what a worker does at start: autodiscovery
    assert "metrics.flag_idle_jobs" in app.tasks
