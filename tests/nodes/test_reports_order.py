"""Reports that arrive out of order still leave a consistent job: an exit applied before the
`running` report (lost, or overtaken) gives the job a start."""
import pytest

from portal.jobs.models import Job


def event(agent, job, state, **kw):
    return agent.post(f"/api/agent/v1/jobs/{job.pk}/events", {"attempt": 1, "state": state, **kw}, format="json")


@pytest.mark.parametrize("state,code", [("succeeded", 0), ("failed", 3), ("timeout", 143)])
def test_an_exit_before_the_running_report_still_gives_the_job_a_start(starting, state, code):
    agent, job = starting, starting.job
    assert event(agent, job, state, exit_code=code).status_code == 200
    assert event(agent, job, "running").status_code == 409  # too late: the job has ended
    job = Job.objects.get(pk=job.pk)
    assert job.state == state and job.started_at is not None and job.started_at == job.ended_at


def test_a_launch_that_never_started_has_no_start(starting):
    agent, job = starting, starting.job
    assert event(agent, job, "failed", message="bad spec: no such image").status_code == 200
    job = Job.objects.get(pk=job.pk)
    assert job.state == "failed" and job.started_at is None
