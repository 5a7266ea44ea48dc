"""End to end on the real parts: the portal (live server on PostgreSQL), a real Celery worker
for the scheduler queue, the broker from CELERY_BROKER_URL (Redis in CI), a real agent
process (`python -m agents`) with simulated GPUs, and the real Docker engine (or libvirtd booting a
real VM per job for the kvm sandbox).
"""
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.nodes.models import Node
from portal.jobs.node_effects import nodes_reap
from portal.nodes.services import node_add
from tests.conftest import make_token
from tests.procs import start_process, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "gpuportal/busybox:latest"
pytestmark = pytest.mark.django_db(transaction=True)


def _db_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


class Stack:
    def __init__(self, live_server, tmp_path, demo, sandbox="docker"):
        assert connection.vendor == "postgresql", "the end-to-end stack needs PostgreSQL (DATABASE_URL)"
        assert not settings.CELERY_BROKER_URL.startswith("filesystem"), \
            "the end-to-end stack needs a broker server: set CELERY_BROKER_URL=redis://... (.ci/run does)"
        import docker

        self.docker = docker.from_env()
        self.docker.ping()
        self.tmp = tmp_path
        self.sandbox = sandbox
        self.url = live_server.url
        self.name = f"e2e-{uuid.uuid4().hex[:8]}"
        _, self.node_token = node_add(actor=Actor(user=demo.users["admin"]), name=self.name)
        self.client = APIClient()
        self.client.credentials(HTTP_AUTHORIZATION=f"Bearer {make_token(demo.users['alice'], ['read', 'submit'])}")
        self.env = {**os.environ, "DATABASE_URL": _db_url(), "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
                    "DEBUG": "1"}
        self.procs = {}

    def start_all(self):
        """The scheduler worker, then the agent. Started from the fixture's try block: whatever
        fails here, close() stops what already runs."""
        self.start("worker", [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "scheduler",
                              "-P", "solo", "-n", f"sched-{self.name}@%h", "--loglevel", "INFO"])
        self.start_agent()

    def start(self, key, argv):
        log = open(self.tmp / f"{key}.log", "a+")
        self.procs[key] = (start_process(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT), log)

    def log(self, key) -> str:
        log = self.procs[key][1]
        log.flush()
        return (self.tmp / f"{key}.log").read_text()

    def start_agent(self):
        self.start("agent", [sys.executable, "-m", "agents", "--portal", self.url, "--token", self.node_token,
                             "--broker", settings.CELERY_BROKER_URL, "--name", self.name, "--gpus", "sim:2xH100-80GB",
                             "--sandbox", self.sandbox, "--stop-grace", "1"])
        wait_for(lambda: "ready." in self.log("agent") or self.procs["agent"][0].poll() is not None, 60,
                 "the agent's Celery worker")
        assert self.procs["agent"][0].poll() is None, self.log("agent")[-3000:]
        wait_for(lambda: "ready." in self.log("worker"), 60, "the scheduler worker")

    def kill_agent(self):
        proc = self.procs["agent"][0]
        proc.kill()  # the agent alone, as a crash would: its sandboxes stay for the next start to adopt
        proc.wait(10)

    def submit(self, **over):
        body = {"project": "vision", "name": "e2e", "image": IMAGE, "command": ["sh", "-c", "echo hello"],
                "resources": {"gpus": 0, "cpus": 0.5, "memory_mb": 128}, "time_limit": 120, **over}
        r = self.client.post("/api/v1/jobs/", data=body, format="json")
        assert r.status_code == 201, r.content
        return r.json()["id"]

    def job(self, job_id) -> dict:
        return self.client.get(f"/api/v1/jobs/{job_id}/").json()

    def wait_state(self, job_id, states, timeout=90):
        states = {states} if isinstance(states, str) else set(states)
        return wait_for(lambda: (j := self.job(job_id))["state"] in states and j, timeout,
                        f"job {job_id} to reach {states}; agent log:\n{self.log('agent')[-4000:]}\n"
                        f"worker log:\n{self.log('worker')[-2000:]}")

    def containers(self, job_id):
        return self.docker.containers.list(all=True, filters={"label": [f"gpuportal.job={job_id}",
                                                                        f"gpuportal.node={self.name}"]})

    def close(self):
        for proc, log in self.procs.values():
            stop_process(proc)
            log.close()
        for c in self.docker.containers.list(all=True, filters={"label": [f"gpuportal.node={self.name}"]}):
            c.remove(force=True)


@pytest.fixture
def stack(live_server, tmp_path, demo, settings):
    settings.NODE_HEARTBEAT_INTERVAL_S = 1.0
    settings.AGENT_LEASE_S = 4.0
    settings.NODE_TIMEOUT_S = 6.0
    settings.LAUNCH_RESEND_S = 5
    s = Stack(live_server, tmp_path, demo)
    try:
        s.start_all()
        yield s
    finally:
        s.close()


@pytest.fixture
def kvm_stack(live_server, tmp_path, demo, settings):
    settings.NODE_HEARTBEAT_INTERVAL_S = 1.0
    s = Stack(live_server, tmp_path, demo, sandbox="kvm")
    try:
        s.start_all()
        yield s
    finally:
        s.close()


def test_a_kvm_job_boots_its_vm_runs_in_its_image_and_succeeds(kvm_stack):
    """The kvm sandbox end to end: scheduled to the kvm node (it registered as one), a real VM through
    libvirtd (var/kvm from .ci/kvm.sh), the job's image from the engine, logs and exit code back."""
    stack = kvm_stack
    assert Node.objects.get(name=stack.name).sandbox == "kvm"
    job_id = stack.submit(sandbox="kvm", command=["sh", "-c", "echo hello from a vm; id -u; exit 4"])
    job = stack.wait_state(job_id, {"failed", "succeeded"}, timeout=180)
    assert job["state"] == "failed" and job["exit_code"] == 4 and job["node"] == stack.name
    logs = wait_for(lambda: (r := stack.client.get(f"/api/v1/jobs/{job_id}/logs/").json())["data"].endswith("65534\n")
                    and r, 30, "the log tail")
    assert logs["data"] == "hello from a vm\n65534\n"
    # A docker job has nowhere to go in this cluster: it waits and says why.
    other = stack.submit()
    wait_for(lambda: stack.job(other)["reason"]["code"] == "sandbox", 30, "the docker job's reason")


def test_job_runs_to_success_with_logs(stack):
    job_id = stack.submit(command=["sh", "-c", "echo hello from $GPUPORTAL_JOB_ID; echo done"])
    job = stack.wait_state(job_id, "succeeded")
    assert job["exit_code"] == 0 and job["node"] == stack.name
    assert [e["state"] for e in job["events"]] == ["assigned", "starting", "running", "succeeded"]
    logs = wait_for(lambda: (r := stack.client.get(f"/api/v1/jobs/{job_id}/logs/").json())["data"].endswith("done\n")
                    and r, 30, "the log tail")
    assert logs["data"] == f"hello from {job_id}\ndone\n"


def test_failing_command_reports_exit_code(stack):
    job = stack.wait_state(stack.submit(command=["sh", "-c", "echo oops >&2; exit 3"]), {"failed", "succeeded"})
    assert job["state"] == "failed" and job["exit_code"] == 3


def test_time_limit_is_enforced(stack):
    job = stack.wait_state(stack.submit(command=["sleep", "60"], time_limit=2), {"timeout", "failed", "succeeded"})
    assert job["state"] == "timeout"


def test_gpu_job_on_simulated_gpus_runs_with_the_gpu_environment(stack):
    """The demo's case: simulated GPUs on an engine without the NVIDIA runtime. The job runs in the
    same hardened container, sees the GPU environment, and its log and page say the GPUs are simulated."""
    job_id = stack.submit(resources={"gpus": 2, "cpus": 0.5, "memory_mb": 128},
                          command=["sh", "-c", "echo CUDA=$CUDA_VISIBLE_DEVICES NVIDIA=$NVIDIA_VISIBLE_DEVICES"])
    job = stack.wait_state(job_id, {"failed", "succeeded"})
    assert job["state"] == "succeeded" and job["exit_code"] == 0, job
    logs = wait_for(lambda: (r := stack.client.get(f"/api/v1/jobs/{job_id}/logs/").json())["data"].endswith("\n")
                    and "CUDA=" in r["data"] and r, 30, "the log tail")
    first, second = logs["data"].splitlines()
    assert first.startswith("[gpuportal] simulated GPUs: no NVIDIA runtime, the job sees the GPU environment only")
    assert second == "CUDA=0,1 NVIDIA=void"
    assert any("simulated GPUs" in w for w in job["warnings"]), job["warnings"]
    # The container's hardening on simulated GPUs: tests/agents/test_docker_driver.py.


def test_cancel_while_running_removes_the_container(stack):
    job_id = stack.submit(command=["sleep", "300"])
    stack.wait_state(job_id, "running")
    assert stack.containers(job_id)
    r = stack.client.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert r.status_code == 202 and r.json()["state"] == "cancelled"
    wait_for(lambda: not [c for c in stack.containers(job_id) if c.status == "running"], 30,
             f"the container to stop; agent log:\n{stack.log('agent')[-3000:]}")


def test_duplicate_launch_starts_nothing_twice(stack):
    from portal.launch import launch_spec
    from scheduler.dispatch import send_launch

    job_id = stack.submit(command=["sleep", "300"])
    stack.wait_state(job_id, "running")
    job = Job.objects.get(pk=job_id)
    spec = launch_spec(job.pk, stack.name)
    send_launch(stack.name, job.pk, job.attempt, spec)
    send_launch(stack.name, job.pk, job.attempt, spec)
    # Both duplicates must have been handled (the agent logs each) before the count means anything.
    wait_for(lambda: stack.log("agent").count(f"job {job_id} attempt {job.attempt}: duplicate launch") >= 2, 30,
             f"the duplicate launches to arrive; log:\n{stack.log('agent')[-2000:]}")
    assert len(stack.containers(job_id)) == 1


def test_agent_killed_node_down_job_requeued_then_reconciled(stack):
    job_id = stack.submit(command=["sleep", "300"])
    stack.wait_state(job_id, "running")
    stack.kill_agent()
    # The portal waits past the heartbeat timeout before it believes the node is gone.
    Node.objects.filter(name=stack.name).update(last_heartbeat_at=timezone.now() - timedelta(seconds=7))
    assert nodes_reap()["requeued"] == 1
    assert Node.objects.get(name=stack.name).state == "down"
    job = stack.job(job_id)
    assert job["state"] == "queued" and job["attempt"] == 2
    # The restarted agent finds attempt 1's container by label, reports it, is told to stop it,
    # and the requeued attempt 2 runs on the node that came back.
    stack.start_agent()
    job = stack.wait_state(job_id, "running")
    assert job["attempt"] == 2
    wait_for(lambda: [c.labels.get("gpuportal.attempt") for c in stack.containers(job_id) if c.status == "running"]
             == ["2"], 60, f"only attempt 2 to run; agent log:\n{stack.log('agent')[-3000:]}")
