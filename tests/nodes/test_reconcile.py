"""Reconciliation of what a node holds (its heartbeat) with what the portal placed there: a
launch not yet running is re-sent, in `assigned` or `starting`; one the node still does not hold
after LAUNCH_LOST_S is requeued instead of holding GPUs with nothing running."""
from datetime import timedelta

from django.utils import timezone

from portal.jobs.models import Allocation, Job
from scheduler.adapter import run_pass


def age(job, seconds):
    Job.objects.filter(pk=job.pk).update(state_changed_at=timezone.now() - timedelta(seconds=seconds))


def heartbeat(agent, jobs):
    r = agent.post("/api/agent/v1/heartbeat", {"samples": [], "jobs": jobs}, format="json")
    assert r.status_code == 200
    return r.json()


def test_a_starting_job_not_yet_running_gets_its_launch_again(starting, sent, settings,
                                                              django_capture_on_commit_callbacks):
    job = starting.job
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        run_pass()
    assert not [a for t, _, a in sent if t == "agent.launch"]  # just confirmed: nothing to re-send
    age(job, settings.LAUNCH_RESEND_S + 1)
    with django_capture_on_commit_callbacks(execute=True):
        run_pass()
    assert [(n, a[:2]) for t, n, a in sent if t == "agent.launch"] == [("gpu-01", [str(job.pk), 1])]


def test_a_job_the_node_does_not_hold_past_the_limit_is_requeued(starting, settings):
    job = starting.job
    age(job, settings.LAUNCH_LOST_S + 1)
    heartbeat(starting, [{"job_id": str(job.pk), "attempt": 1, "state": "starting"}])  # still launching there
    assert Job.objects.get(pk=job.pk).state == "starting"
    heartbeat(starting, [])  # the agent restarted: it holds nothing
    job.refresh_from_db()
    assert job.state == "queued" and job.attempt == 2 and job.reason_code == "node_fail"
    assert "never started it" in job.reason_message
    assert not Allocation.objects.filter(job=job, released_at__isnull=True).exists()  # GPUs no longer held


def test_a_recent_launch_the_node_does_not_list_yet_is_left_alone(starting):
    heartbeat(starting, [])  # the launch may still be on its way
    assert Job.objects.get(pk=starting.job.pk).state == "starting"


def running(agent):
    job = agent.job
    r = agent.post(f"/api/agent/v1/jobs/{job.pk}/events", {"attempt": 1, "state": "running"}, format="json")
    assert r.status_code == 200, r.content
    return job


def test_a_running_job_its_node_no_longer_holds_is_requeued_not_left_running(starting, settings):
    """The agent restarted and found no sandbox and no exit of it: without this it stayed `running`
    (billed) for good."""
    job = running(starting)
    heartbeat(starting, [])  # just started: a heartbeat sent before the sandbox existed may still arrive
    assert Job.objects.get(pk=job.pk).state == "running"
    age(job, settings.LAUNCH_LOST_S + 1)
    # Held, or ended there with the report still on its way: left alone.
    heartbeat(starting, [{"job_id": str(job.pk), "attempt": 1, "state": "running"}])
    heartbeat(starting, [{"job_id": str(job.pk), "attempt": 1, "state": "succeeded"}])
    assert Job.objects.get(pk=job.pk).state == "running"
    heartbeat(starting, [{"job_id": str(job.pk), "attempt": 0, "state": "running"}])  # another attempt's
    job.refresh_from_db()
    assert job.state == "queued" and job.attempt == 2 and job.reason_code == "node_fail"
    assert "no longer holds it" in job.reason_message
    assert not Allocation.objects.filter(job=job, released_at__isnull=True).exists()
    # The old attempt's end, should it come after all, is stale.
    r = starting.post(f"/api/agent/v1/jobs/{job.pk}/events", {"attempt": 1, "state": "succeeded", "exit_code": 0},
                      format="json")
    assert r.status_code == 409 and Job.objects.get(pk=job.pk).state == "queued"


def test_a_lost_running_job_out_of_attempts_ends_node_fail(starting, settings):
    settings.JOB_MAX_ATTEMPTS = 1
    job = running(starting)
    age(job, settings.LAUNCH_LOST_S + 1)
    heartbeat(starting, [])
    job.refresh_from_db()
    assert job.state == "node_fail" and job.attempt == 1 and "no longer holds it" in job.reason_message
