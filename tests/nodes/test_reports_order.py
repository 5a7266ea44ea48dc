"""Reports that arrive out of order still leave a consistent job: an exit applied before the
`running` report (lost, or overtaken) gives the job a start."""
import pytest
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.jobs.services import job_submit
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

INVENTORY = [{"index": 0, "uuid": "GPU-ord-0", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}]


@pytest.fixture
def placed(demo, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert agent.post("/api/agent/v1/register", {"name": "gpu-01", "cpus": 8, "memory_mb": 1, "sandbox": "docker",
                                                 "gpus": INVENTORY}, format="json").status_code == 200
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})
    run_pass()
    assert agent.post(f"/api/agent/v1/jobs/{job.pk}/confirm", {"attempt": 1}, format="json").status_code == 200
    return agent, job


def event(agent, job, state, **kw):
    return agent.post(f"/api/agent/v1/jobs/{job.pk}/events", {"attempt": 1, "state": state, **kw}, format="json")


@pytest.mark.parametrize("state,code", [("succeeded", 0), ("failed", 3), ("timeout", 143)])
def test_an_exit_before_the_running_report_still_gives_the_job_a_start(placed, state, code):
    agent, job = placed
    assert event(agent, job, state, exit_code=code).status_code == 200
    assert event(agent, job, "running").status_code == 409  # too late: the job has ended
    job = Job.objects.get(pk=job.pk)
    assert job.state == state and job.started_at is not None and job.started_at == job.ended_at


def test_a_launch_that_never_started_has_no_start(placed):
    agent, job = placed
    assert event(agent, job, "failed", message="bad spec: no such image").status_code == 200
    job = Job.objects.get(pk=job.pk)
    assert job.state == "failed" and job.started_at is None
