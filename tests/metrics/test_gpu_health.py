"""What a GPU turning unhealthy does to its jobs and node (docs/design.md section 6)."""
import pytest
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job, JobEvent
from portal.jobs.services import job_submit
from portal.nodes.models import Node
from portal.jobs.node_effects import node_drain
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import IMAGE
from tests.metrics.test_metrics import sample

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("passes_here")]  # the tests run passes


def agent(demo, name, gpus="2xH100-80GB"):
    node, secret = node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus=gpus)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    client.node, client.gpus = node, list(node.gpus.order_by("index"))
    return client


def running_job(demo, client, *, preemptible):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "train", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1},
        "preemptible": preemptible})
    run_pass()
    for path, body in [("confirm", {"attempt": 1}), ("events", {"attempt": 1, "state": "running"})]:
        assert client.post(f"/api/agent/v1/jobs/{job.pk}/{path}", data=body, format="json").status_code == 200
    return Job.objects.get(pk=job.pk)


def held_gpu(job):
    return Allocation.objects.get(job=job, released_at__isnull=True).gpu


def heartbeat(client, samples, capture):
    with capture(execute=True):
        r = client.post("/api/agent/v1/heartbeat", data={"samples": samples, "jobs": []}, format="json")
    assert r.status_code == 200, r.content
    return r


@pytest.mark.parametrize("bad", [{"temperature_c": 97}, {"xid_errors": [79]}])
def test_preemptible_job_is_requeued_and_placed_on_another_gpu(demo, sent, bad, django_capture_on_commit_callbacks):
    client = agent(demo, "gpu-01")
    job = running_job(demo, client, preemptible=True)
    gpu = held_gpu(job)
    sent.clear()
    heartbeat(client, [sample(gpu, **bad)], django_capture_on_commit_callbacks)

    job.refresh_from_db()
    assert (job.state, job.attempt, job.reason_code) == ("queued", 2, "gpu_unhealthy")
    assert f"GPU {gpu.index} of node gpu-01 is unhealthy" in job.reason_message
    # The old attempt is told to stop; its reports are stale from now on.
    assert ("agent.stop", "gpu-01", [str(job.pk), 1, "gpu_unhealthy", 30]) in sent
    assert client.post(f"/api/agent/v1/jobs/{job.pk}/events", data={"attempt": 1, "state": "running"},
                       format="json").status_code == 409

    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned"
    assert held_gpu(job).pk != gpu.pk
    assert Allocation.objects.get(job=job, attempt=1).released_at is not None


def test_non_preemptible_job_keeps_running_with_a_warning(demo, sent, django_capture_on_commit_callbacks):
    client = agent(demo, "gpu-01")
    job = running_job(demo, client, preemptible=False)
    gpu = held_gpu(job)
    sent.clear()
    heartbeat(client, [sample(gpu, ecc_errors=5)], django_capture_on_commit_callbacks)

    job.refresh_from_db()
    assert (job.state, job.attempt, job.reason_code) == ("running", 1, "gpu_unhealthy")
    assert "keeps running because it is not preemptible" in job.reason_message
    warning = JobEvent.objects.filter(job=job).latest("id")
    assert warning.state == "running" and not warning.terminal and "ECC errors" in warning.message
    assert not [c for c in sent if c[0] == "agent.stop"]
    # The warning shows on the job in the API and on its page.
    body = APIClient()
    body.force_login(demo.users["alice"])
    assert body.get(f"/api/v1/jobs/{job.pk}/").json()["reason"]["code"] == "gpu_unhealthy"
    assert "keeps running" in body.get(f"/jobs/{job.pk}/").content.decode()
    # A second hot heartbeat changes nothing: the GPU is already unhealthy.
    heartbeat(client, [sample(gpu, ecc_errors=6)], django_capture_on_commit_callbacks)
    assert JobEvent.objects.filter(job=job, message__contains="keeps running").count() == 1


def test_out_of_attempts_is_warned_not_requeued(demo, sent, settings, django_capture_on_commit_callbacks):
    client = agent(demo, "gpu-01")
    settings.JOB_MAX_ATTEMPTS = 1
    job = running_job(demo, client, preemptible=True)
    heartbeat(client, [sample(held_gpu(job), temperature_c=99)], django_capture_on_commit_callbacks)
    job.refresh_from_db()
    assert job.state == "running" and "no attempts left" in job.reason_message


def test_auto_drain_moves_the_job_to_another_node(demo, sent, settings, django_capture_on_commit_callbacks):
    settings.GPU_HEALTH_AUTO_DRAIN = True
    client = agent(demo, "gpu-01")
    job = running_job(demo, client, preemptible=True)
    agent(demo, "gpu-02")
    heartbeat(client, [sample(held_gpu(job), xid_errors=48)], django_capture_on_commit_callbacks)

    node = Node.objects.get(name="gpu-01")
    assert node.state == "drained" and node.state_reason.startswith("Auto-drained: GPU")
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned" and job.node.name == "gpu-02"
    # The next heartbeat tells the agent to drain.
    assert heartbeat(client, [], django_capture_on_commit_callbacks).json()["drain"] is True


def test_auto_drain_off_leaves_the_node_ready(demo, sent, django_capture_on_commit_callbacks):
    client = agent(demo, "gpu-01")
    heartbeat(client, [sample(client.gpus[0], temperature_c=99)], django_capture_on_commit_callbacks)
    assert Node.objects.get(name="gpu-01").state == "ready"


def test_system_actor_may_drain_but_people_need_staff(demo):
    from portal.core.errors import Forbidden

    node = agent(demo, "gpu-01").node
    with pytest.raises(Forbidden):
        node_drain(actor=Actor(user=demo.users["alice"]), node=node)
    with pytest.raises(Forbidden):
        node_drain(actor=Actor(user=None), node=node)  # an anonymous request's actor has no label
    assert node_drain(actor=Actor(user=None, label="gpu-health"), node=node).state == "drained"
