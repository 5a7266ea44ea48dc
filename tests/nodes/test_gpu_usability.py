"""GPUs an agent's sandbox cannot serve (docker without the NVIDIA runtime): registered as unusable,
shown with the reason on the nodes page, skipped by the scheduler, back in service once fixed."""
import pytest
from django.test import Client
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.services import job_submit
from portal.nodes.models import GPU
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"
INVENTORY = [{"index": i, "uuid": f"GPU-nort-{i}", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559,
              "pci_bus_id": f"0000:0{i}:00.0"} for i in range(4)]
REASON = "Unusable for docker jobs: Docker engine has no NVIDIA runtime"


@pytest.fixture
def agent(demo, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    node, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-nort")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")

    def register(**extra):
        r = client.post("/api/agent/v1/register", format="json", data={
            "name": "gpu-nort", "cpus": 32, "memory_mb": 262144, "sandbox": "docker", "gpus": INVENTORY, **extra})
        assert r.status_code == 200, r.content
    client.register = register
    client.node = node
    return client


def submit(demo, gpus):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": IMAGE, "command": ["echo", "hi"], "resources": {"gpus": gpus}})
    return job


def test_unusable_gpus_are_marked_with_the_reason_and_shown_on_the_nodes_page(agent, demo):
    agent.register(gpus_unusable="Docker engine has no NVIDIA runtime")
    gpus = GPU.objects.filter(node=agent.node)
    assert gpus.count() == 4 and set(gpus.values_list("health", "health_reason")) == {("unhealthy", REASON)}
    page = Client()
    page.force_login(demo.users["admin"])
    html = page.get("/nodes/").content.decode()
    assert REASON in html


def test_scheduler_places_no_gpu_job_on_unusable_gpus(agent, demo):
    agent.register(gpus_unusable="Docker engine has no NVIDIA runtime")
    job = submit(demo, 2)
    run_pass()
    job.refresh_from_db()
    assert job.state == "queued" and job.node_id is None
    # A node whose GPUs work takes it.
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-good", gpus="8xH100-80GB")
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned" and job.node.name == "gpu-good"


def test_a_registration_without_the_problem_puts_the_gpus_back_but_not_other_faults(agent, demo):
    agent.register(gpus_unusable="Docker engine has no NVIDIA runtime")
    GPU.objects.filter(node=agent.node, index=3).update(health_reason="Xid error 79 reported by the driver")
    agent.register()  # the operator installed the runtime and restarted the agent
    health = dict(GPU.objects.filter(node=agent.node).values_list("index", "health"))
    assert health == {0: "healthy", 1: "healthy", 2: "healthy", 3: "unhealthy"}
    job = submit(demo, 2)
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned" and job.node_id == agent.node.pk


def test_an_unusable_reason_that_is_too_long_is_a_400(agent):
    r = agent.post("/api/agent/v1/register", format="json", data={
        "name": "gpu-nort", "cpus": 32, "memory_mb": 262144, "sandbox": "docker", "gpus": INVENTORY,
        "gpus_unusable": "x" * 151})
    assert r.status_code == 400 and "gpus_unusable" in r.json()["error"]["fields"]
    assert GPU.objects.filter(node=agent.node, health="unhealthy").count() == 0
