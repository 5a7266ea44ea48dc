"""A node that fenced a job because its lease ran out (its agent cut off or frozen, back before the
reaper's timeout) says so in the end report: the portal requeues the job as a node fault, a new
attempt, not the user's failure, and the old attempt's GPUs are released and billed once, to the
moment of the requeue (docs/reliability.md F-05)."""
from decimal import Decimal

from portal.billing.models import UsageRecord
from portal.billing.services import usage_meter
from portal.jobs.models import Allocation, Job, JobEvent


def event(agent, job, state, attempt=1, **kw):
    return agent.post(f"/api/agent/v1/jobs/{job.pk}/events", {"attempt": attempt, "state": state, **kw},
                      format="json")


def test_a_fenced_end_requeues_the_job_as_a_node_fault(starting):
    agent, job = starting, starting.job
    assert event(agent, job, "running").status_code == 200
    r = event(agent, job, "failed", exit_code=143, message="killed on the node: its lease ran out",
              lease_expired=True)
    assert r.status_code == 200 and r.json()["result"] == "applied"
    job = Job.objects.get(pk=job.pk)
    assert job.state == "queued" and job.attempt == 2 and job.reason_code == "node_fail"
    assert job.exit_code is None and job.ended_at is None
    # No terminal event: the job has not ended; its timeline says why it went back.
    assert not JobEvent.objects.filter(job=job, terminal=True).exists()
    requeue = JobEvent.objects.get(job=job, attempt=1, state="queued")
    assert "lease ran out" in requeue.message and "Requeued as attempt 2" in requeue.message
    # The old attempt's allocation is closed at the requeue, and billed exactly that.
    (alloc,) = Allocation.objects.filter(job=job, attempt=1)
    assert alloc.released_at == job.state_changed_at
    usage_meter()
    billed = sum(u.gpu_seconds for u in UsageRecord.objects.filter(allocation=alloc))
    held = Decimal((alloc.released_at - alloc.started_at).total_seconds())
    assert abs(billed - held) < Decimal("0.001")
    # A retry of the report, and any later report of the old attempt, are stale.
    assert event(agent, job, "failed", exit_code=143, lease_expired=True).status_code == 409


def test_a_fenced_end_out_of_attempts_ends_node_fail(starting, settings):
    agent, job = starting, starting.job
    settings.JOB_MAX_ATTEMPTS = 1
    assert event(agent, job, "failed", exit_code=137, lease_expired=True).status_code == 200
    job = Job.objects.get(pk=job.pk)
    assert job.state == "node_fail" and job.attempt == 1
    assert list(JobEvent.objects.filter(job=job, terminal=True).values_list("state", flat=True)) == ["node_fail"]


def test_the_same_end_without_the_flag_is_the_job_s_failure(starting):
    agent, job = starting, starting.job
    assert event(agent, job, "failed", exit_code=143).status_code == 200
    job = Job.objects.get(pk=job.pk)
    assert job.state == "failed" and job.exit_code == 143 and job.attempt == 1


def test_a_success_is_a_success_whatever_the_flag_says(starting):
    agent, job = starting, starting.job
    assert event(agent, job, "succeeded", exit_code=0, lease_expired=True).status_code == 200
    assert Job.objects.get(pk=job.pk).state == "succeeded"


def test_a_bad_flag_is_a_400_on_the_field(starting):
    r = event(starting, starting.job, "failed", lease_expired="perhaps")
    assert r.status_code == 400 and "lease_expired" in r.json()["error"]["fields"]
