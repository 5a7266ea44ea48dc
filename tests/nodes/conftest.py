"""Shared by the agent-API tests of this folder: a registered node with a confirmed job."""
import pytest
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.services import job_submit
from portal.nodes.services import node_add
from scheduler.adapter import run_pass


@pytest.fixture
def starting(demo, sent):
    """Node gpu-01's agent (registered, an APIClient with its token) and a 1-GPU job it confirmed:
    `starting`, nothing reported since. `agent.job` is the job."""
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    inventory = [{"index": 0, "uuid": "GPU-start-0", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}]
    assert agent.post("/api/agent/v1/register", {"name": "gpu-01", "cpus": 8, "memory_mb": 65536, "sandbox": "docker",
                                                 "gpus": inventory}, format="json").status_code == 200
    agent.job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})
    run_pass()
    assert agent.post(f"/api/agent/v1/jobs/{agent.job.pk}/confirm", {"attempt": 1}, format="json").status_code == 200
    return agent
