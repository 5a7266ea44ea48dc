"""Checkpoint-aware stops through the portal (docs/jobs.md, "Checkpoints"): preemption, an
operator's move, a node drain and a GPU fault requeue a checkpointing job and send its old attempt
its signal and grace; the next attempt is not placed until the old one has stopped."""
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job
from portal.jobs.reports import job_report
from portal.jobs.services import job_move, job_submit
from portal.jobs.node_effects import gpu_unhealthy_handle, node_drain
from portal.nodes.services import node_add
from scheduler import adapter

IMAGE = "gpuportal/busybox:latest"
pytestmark = pytest.mark.django_db(transaction=True)


def submit(demo, name, gpus, checkpoint=None, **extra):
    data = {"project": "vision", "name": name, "image": IMAGE, "command": ["true"], "resources": {"gpus": gpus},
            "time_limit": 86400, **extra}
    if checkpoint:
        data["checkpoint"] = checkpoint
    return job_submit(actor=Actor(user=demo.users["alice"]), data=data)[0]


def run(node, job):
    adapter.run_pass()
    job.refresh_from_db()
    assert job.state == "assigned", (job.state, job.reason_message)
    job_report(node=node, job_id=job.pk, attempt=job.attempt, state="running")
    job.refresh_from_db()
    return job


def started_ago(job, seconds: float) -> None:
    for a in Allocation.objects.filter(job=job, released_at__isnull=True):
        a.started_at -= timedelta(seconds=seconds)
        a.save(update_fields=["started_at"])


def stops(sent):
    return [(node, args) for task, node, args in sent if task == "agent.stop"]


@pytest.fixture
def node(demo, sent, monkeypatch):
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: None)  # the tests run passes
    made, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    return made


def test_a_preempted_checkpointing_job_gets_its_signal_and_waits_for_its_old_attempt(demo, sent, node, settings):
    settings.SCHEDULER_POLICY = "las"
    settings.SCHEDULER_MIN_RUNTIME_S = 60
    settings.PREEMPT_GRACE_S = 30
    saver = run(node, submit(demo, "saver", 2, {"signal": "SIGUSR2", "grace_s": 45}))
    started_ago(saver, 2 * 3600)
    sent.clear()
    submit(demo, "new", 2)
    assert adapter.run_pass()["preempted"] == 1
    saver.refresh_from_db()
    assert saver.state == "queued" and saver.attempt == 2 and saver.reason_code == "preempted"
    assert "SIGUSR2 and 45 s to checkpoint" in saver.reason_message
    assert stops(sent) == [("gpu-01", [str(saver.pk), 1, "preempted", 45, "SIGUSR2"])]
    assert timezone.now() + timedelta(seconds=60) < saver.resume_after <= timezone.now() + timedelta(seconds=75)
    # Not placed while attempt 1 may still be writing its checkpoint ...
    snap, _ = adapter.build_snapshot()
    assert str(saver.pk) not in {j.id for j in snap.queued}
    # ... the heartbeat's stop for it carries the signal too ...
    from portal.jobs.reports import stale_reports

    assert stale_reports(node=node, reported=[{"job_id": str(saver.pk), "attempt": 1, "state": "running"}]) == [
        {"job_id": str(saver.pk), "attempt": 1, "reason": "stale attempt (now 2)", "signal": "SIGUSR2", "grace_s": 45}]
    # ... and once that attempt's end is reported (a stale report, answered 409), it may go.
    with pytest.raises(Exception, match="stop it"):
        job_report(node=node, job_id=saver.pk, attempt=1, state="cancelled", message="stopped")
    saver.refresh_from_db()
    assert saver.resume_after is None
    snap, _ = adapter.build_snapshot()
    (queued,) = [j for j in snap.queued if j.id == str(saver.pk)]
    assert queued.checkpoint_grace_s == 45


def test_a_job_that_does_not_checkpoint_is_stopped_as_before(demo, sent, node, settings):
    settings.SCHEDULER_POLICY = "las"
    settings.SCHEDULER_MIN_RUNTIME_S = 60
    settings.PREEMPT_GRACE_S = 30
    plain = run(node, submit(demo, "plain", 2))
    started_ago(plain, 2 * 3600)
    sent.clear()
    submit(demo, "new", 2)
    assert adapter.run_pass()["preempted"] == 1
    plain.refresh_from_db()
    assert plain.resume_after is None and plain.state == "queued"
    assert stops(sent) == [("gpu-01", [str(plain.pk), 1, "preempted", 30])]


def test_an_operator_moves_a_running_job_and_it_resumes_elsewhere(demo, sent, node):
    job = run(node, submit(demo, "saver", 1, {"grace_s": 120}))
    sent.clear()
    moved = job_move(actor=Actor(user=demo.users["admin"]), job=job)
    assert moved.state == "queued" and moved.attempt == 2 and moved.reason_code == "moved"
    assert stops(sent) == [("gpu-01", [str(job.pk), 1, "moved", 120, "SIGUSR1"])]
    assert not Allocation.objects.filter(job=job, released_at__isnull=True).exists()


def test_move_through_the_api_is_for_operators_and_running_jobs(demo, api, sent, node):
    job = run(node, submit(demo, "saver", 1, {"grace_s": 120}))
    assert api("alice").post(f"/api/v1/jobs/{job.pk}/move/").status_code == 403  # its owner is no operator
    assert api("charlie").post(f"/api/v1/jobs/{job.pk}/move/").status_code == 404  # another tenant
    r = api("admin").post(f"/api/v1/jobs/{job.pk}/move/")
    assert r.status_code == 202, r.json()
    assert r.json()["state"] == "queued" and r.json()["checkpoint"] == {"signal": "SIGUSR1", "grace_s": 120}
    r = api("admin").post(f"/api/v1/jobs/{job.pk}/move/")
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_running"


def test_a_drain_moves_checkpointing_jobs_and_leaves_the_others(demo, sent, node):
    saver = run(node, submit(demo, "saver", 1, {"grace_s": 60}))
    plain = run(node, submit(demo, "plain", 1))
    sent.clear()
    drained = node_drain(actor=Actor(user=demo.users["admin"]), node=node)
    assert drained.state == "draining"  # the plain job still runs there
    saver.refresh_from_db()
    plain.refresh_from_db()
    assert saver.state == "queued" and saver.reason_code == "node_drained" and plain.state == "running"
    assert stops(sent) == [("gpu-01", [str(saver.pk), 1, "node_drained", 60, "SIGUSR1"])]


def test_a_gpu_fault_moves_a_checkpointing_job(demo, sent, node):
    saver = run(node, submit(demo, "saver", 1, {"grace_s": 60}))
    gpu = Allocation.objects.get(job=saver, released_at__isnull=True).gpu
    sent.clear()
    from django.db import transaction

    with transaction.atomic():
        out = gpu_unhealthy_handle(gpu=gpu, reason="Xid 79")
    assert out["requeued"] == [saver.pk]
    saver.refresh_from_db()
    assert saver.state == "queued" and saver.attempt == 2 and saver.resume_after is not None
    assert stops(sent) == [("gpu-01", [str(saver.pk), 1, "gpu_unhealthy", 60, "SIGUSR1"])]


def test_the_launch_spec_carries_the_checkpoint_signal(demo, sent, node):
    from portal.launch import launch_spec

    job = run(node, submit(demo, "saver", 1, {"signal": "SIGINT", "grace_s": 30}))
    spec = launch_spec(job.pk, "gpu-01")
    assert (spec["checkpoint_signal"], spec["checkpoint_grace_s"]) == ("SIGINT", 30)
    plain = run(node, submit(demo, "plain", 1))
    assert launch_spec(plain.pk, "gpu-01")["checkpoint_signal"] is None


def test_a_save_interval_reaches_the_job_and_the_scheduler(demo, sent, node):
    from agents.sandbox import LaunchSpec, job_env
    from portal.launch import launch_spec

    job = run(node, submit(demo, "saver", 1, {"grace_s": 30, "interval_s": 1800}))
    spec = launch_spec(job.pk, "gpu-01")
    env = job_env(LaunchSpec.from_dict(spec, job_id=str(job.pk), attempt=job.attempt), visible_devices=["0"])
    assert env["GPUPORTAL_CHECKPOINT_INTERVAL_S"] == "1800"
    # The core sees it as a job that keeps only its periodic saves (docs/scheduler.md).
    held = {a.job.id: a.job for a in adapter.build_snapshot()[0].running}
    assert held[str(job.pk)].checkpoint_interval_s == 1800 and held[str(job.pk)].checkpoint_grace_s == 30
    signalled = run(node, submit(demo, "signalled", 1, {"grace_s": 30}))
    spec = launch_spec(signalled.pk, "gpu-01")
    env = job_env(LaunchSpec.from_dict(spec, job_id=str(signalled.pk), attempt=1), visible_devices=["1"])
    assert "GPUPORTAL_CHECKPOINT_INTERVAL_S" not in env
    assert {a.job.id: a.job for a in adapter.build_snapshot()[0].running}[str(signalled.pk)].checkpoint_interval_s is None


def test_the_job_api_shows_no_checkpoint_for_a_job_without_one(demo, api, sent, node):
    job = submit(demo, "plain", 1)
    assert api("alice").get(f"/api/v1/jobs/{job.pk}/").json()["checkpoint"] is None
    assert Job.objects.get(pk=job.pk).checkpoint is None
