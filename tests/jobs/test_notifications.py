"""Emails to the submitter: job end, preemption, idle flag; preferences; sent once per key."""
from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import HOLDING, Allocation, Job, JobState, NotificationSent
from portal.jobs.notifications import job_notify, notification_kind
from portal.jobs.services import job_cancel, job_submit
from portal.jobs.states import transition
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"


@pytest.fixture
def queued(monkeypatch):
    """Run `jobs.notify` in-process where the portal would queue it; record what was queued."""
    from portal.celery import app
    from portal.jobs.tasks import notify

    calls = []

    def send_task(name, args=(), queue=None, **kwargs):
        if name == notify.name:  # queued by name: run the task that name points to, here
            calls.append((tuple(args), queue))
            notify.apply(args=args)

    monkeypatch.setattr(app, "send_task", send_task)
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: None)
    return calls


@pytest.fixture
def cluster(demo, queued):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    return demo


def placed(demo, capture, **over):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "train", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}, **over})
    with capture(execute=True):
        run_pass()
    return Job.objects.get(pk=job.pk)


def end(job, state, capture, **fields):
    with capture(execute=True):
        assert transition(job.pk, to=state, from_states=HOLDING, attempt=job.attempt, **fields)


@pytest.mark.parametrize("state", ["failed", "timeout", "oom", "node_fail"])
def test_failure_mails_the_submitter_once_after_commit(cluster, queued, state, django_capture_on_commit_callbacks):
    job = placed(cluster, django_capture_on_commit_callbacks)
    assert mail.outbox == []
    end(job, state, django_capture_on_commit_callbacks, exit_code=3, reason_message="Exit code 3")
    (sent,) = mail.outbox
    assert sent.to == ["alice@example.com"]
    assert sent.subject.startswith(f"[gpuportal] Job {job.pk} (train) ended ")
    assert "Exit code 3" in sent.body and f"/jobs/{job.pk}/" in sent.body
    assert queued == [((job.pk, 1, "failed"), "default")]
    # A retried (or doubled) task mails nothing more: the key (job, attempt, kind) is taken.
    assert job_notify(job_id=job.pk, attempt=1, kind="failed") is False
    assert len(mail.outbox) == 1 and NotificationSent.objects.filter(job=job).count() == 1


def test_nothing_is_queued_when_the_transaction_rolls_back(cluster, queued, django_capture_on_commit_callbacks):
    from django.db import transaction

    job = placed(cluster, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RuntimeError):
        with transaction.atomic():
            transition(job.pk, to="failed", from_states=HOLDING)
            raise RuntimeError
    assert mail.outbox == [] and Job.objects.get(pk=job.pk).state == "assigned"


def test_success_is_off_by_default_and_can_be_turned_on(cluster, api, django_capture_on_commit_callbacks):
    first = placed(cluster, django_capture_on_commit_callbacks)
    end(first, "succeeded", django_capture_on_commit_callbacks, exit_code=0)
    assert mail.outbox == []
    r = api("alice").patch("/api/v1/me/notifications/", data={"job_succeeded": True}, format="json")
    assert r.status_code == 200 and r.json()["job_succeeded"] is True
    second = placed(cluster, django_capture_on_commit_callbacks)
    end(second, "succeeded", django_capture_on_commit_callbacks, exit_code=0)
    (sent,) = mail.outbox
    assert sent.subject == f"[gpuportal] Job {second.pk} (train) succeeded"


def test_opting_out_of_failures(cluster, api, django_capture_on_commit_callbacks):
    assert api("alice").patch("/api/v1/me/notifications/", data={"job_failed": False},
                              format="json").status_code == 200
    end(placed(cluster, django_capture_on_commit_callbacks), "failed", django_capture_on_commit_callbacks)
    assert mail.outbox == []


def test_cancel_by_the_user_is_not_mailed(cluster, django_capture_on_commit_callbacks):
    job = placed(cluster, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        job_cancel(actor=Actor(user=cluster.users["alice"]), job=job)
    assert mail.outbox == []


@pytest.mark.clock
def test_preemption_mails_per_attempt(cluster, settings, django_capture_on_commit_callbacks, clock):
    settings.SCHEDULER_MIN_RUNTIME_S = 0
    borrowers = [Job.objects.get(pk=job_submit(actor=Actor(user=cluster.users["charlie"]), data={
        "project": "nlp", "name": "borrow", "image": IMAGE, "command": ["true"], "resources": {"gpus": 2},
        "preemptible": True})[0].pk) for _ in range(4)]
    with django_capture_on_commit_callbacks(execute=True):
        run_pass()
    Allocation.objects.update(started_at=timezone.now() - timedelta(hours=1))
    placed(cluster, django_capture_on_commit_callbacks, resources={"gpus": 4})
    victims = Job.objects.filter(pk__in=[b.pk for b in borrowers], attempt=2)
    assert victims.exists()
    assert sorted(m.subject for m in mail.outbox) == sorted(
        f"[gpuportal] Job {v.pk} (borrow) was stopped and requeued (attempt 1)" for v in victims)
    assert all(m.to == ["charlie@example.com"] for m in mail.outbox)
    assert set(NotificationSent.objects.values_list("kind", "attempt")) == {("preempted", 1)}


def test_requeue_off_an_unhealthy_gpu_counts_as_preemption():
    assert notification_kind("queued", "gpu_unhealthy") == "preempted"
    assert notification_kind("queued", "node_fail") == "preempted"
    assert notification_kind("queued", "preempted") is None  # the PREEMPTED transition before it mailed
    assert notification_kind("preempted") == "preempted"
    assert notification_kind("cancelled") is None and notification_kind("running") is None


@pytest.mark.clock
def test_idle_flag_mails(cluster, django_capture_on_commit_callbacks, clock):
    from portal.metrics.services import jobs_flag_idle
    from portal.metrics.services import rollup_minutes, samples_write

    job = placed(cluster, django_capture_on_commit_callbacks)
    transition(job.pk, to=JobState.RUNNING, from_states=HOLDING)
    now = timezone.now()
    Allocation.objects.filter(job=job).update(started_at=now - timedelta(hours=1))
    gpu_id = Allocation.objects.get(job=job).gpu_id
    samples_write([(gpu_id, now - timedelta(minutes=m), 0.0, 0, 81920, 40.0, 60.0, 0, []) for m in range(1, 40)])
    rollup_minutes(now=now, lookback_minutes=45)
    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_flag_idle()["flagged"] == 1
    (sent,) = mail.outbox
    assert "is holding GPUs it does not use" in sent.subject and "stayed under 5% utilization" in sent.body


def test_array_mails_once_when_it_ends(cluster, django_capture_on_commit_callbacks):
    parent, _ = job_submit(actor=Actor(user=cluster.users["alice"]), data={
        "project": "vision", "name": "sweep", "image": IMAGE, "command": ["true"], "array": "0-3"})
    with django_capture_on_commit_callbacks(execute=True):
        for task in parent.tasks.all():
            transition(task.pk, to="failed", from_states={"queued"})
    (sent,) = mail.outbox
    assert sent.subject == f"[gpuportal] Job {parent.pk} (sweep) ended failed"


def test_a_failed_send_is_retried_and_then_mailed_once(cluster, monkeypatch, django_capture_on_commit_callbacks):
    job = placed(cluster, django_capture_on_commit_callbacks)
    transition(job.pk, to="failed", from_states=HOLDING)

    def down(*args, **kwargs):
        raise ConnectionRefusedError("smtp down")

    monkeypatch.setattr("portal.jobs.notifications.send_mail", down)
    with pytest.raises(ConnectionRefusedError):
        job_notify(job_id=job.pk, attempt=1, kind="failed")
    assert not NotificationSent.objects.filter(job=job).exists()  # rolled back: a retry may send
    monkeypatch.undo()
    assert job_notify(job_id=job.pk, attempt=1, kind="failed") is True
    assert job_notify(job_id=job.pk, attempt=1, kind="failed") is False
    assert len(mail.outbox) == 1


def test_preferences_api_defaults_and_validation(demo, api):
    alice = api("alice")
    assert alice.get("/api/v1/me/notifications/").json() == {
        "job_succeeded": False, "job_failed": True, "job_preempted": True, "job_idle": True}
    r = alice.patch("/api/v1/me/notifications/", data={"job_idle": False}, format="json")
    assert r.json()["job_idle"] is False and r.json()["job_failed"] is True
    assert alice.patch("/api/v1/me/notifications/", data={"job_sms": True}, format="json").status_code == 400
    assert alice.patch("/api/v1/me/notifications/", data={"user": 1}, format="json").status_code == 400
    # Personal: charlie's settings are his own.
    assert api("charlie").get("/api/v1/me/notifications/").json()["job_idle"] is True
