"""The two hottest requests keep a fixed number of queries, whatever they carry (an N+1 guard):
an agent's heartbeat, however many GPU samples and jobs it lists, and a job submit, however many
jobs its user already has. A query per sample or per job would make them grow."""
import time

from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.services import job_submit
from portal.nodes.models import GPU
from scheduler.adapter import run_pass
from tests.conftest import agent_client

IMAGE = "gpuportal/busybox:latest"


def agent_for(demo, name: str, gpus: str) -> tuple[APIClient, list[str]]:
    return agent_client(demo, name, gpus), list(GPU.objects.filter(node__name=name).order_by("index").values_list("uuid", flat=True))


def heartbeat_queries(agent: APIClient, uuids: list[str], per_gpu: int, jobs: list[dict]) -> int:
    body = {"samples": [{"gpu_uuid": u, "ts": time.time(), "utilization": 50, "memory_used_mb": 1000,
                         "temperature_c": 60, "power_w": 300.0, "ecc_errors": 0, "xid_errors": [], "processes": []}
                        for u in uuids for _ in range(per_gpu)], "jobs": jobs}
    assert agent.post("/api/agent/v1/heartbeat", body, format="json").status_code == 200  # warms per-node caches
    with CaptureQueriesContext(connection) as queries:
        r = agent.post("/api/agent/v1/heartbeat", body, format="json")
    assert r.status_code == 200 and r.json()["refused"] == [], r.content
    return len(queries)


def test_heartbeat_queries_do_not_grow_with_samples_or_jobs(demo, sent):
    small, small_uuids = agent_for(demo, "gpu-01", "1xH100-80GB")
    big, big_uuids = agent_for(demo, "gpu-02", "8xH100-80GB")
    idle = heartbeat_queries(small, small_uuids, 1, [])
    assert idle <= 4  # node token, last_heartbeat_at, lost launches (samples are buffered, not written)
    assert heartbeat_queries(big, big_uuids, 5, []) == idle  # 40 samples

    # Jobs the agent lists: checked in one pass whatever their number.
    for _ in range(8):
        job_submit(actor=Actor(user=demo.users["alice"]), data={
            "project": "vision", "name": "j", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}})
    from portal.jobs.models import Job
    from portal.nodes.models import Node

    Node.objects.filter(name="gpu-01").update(state="draining")  # all eight on gpu-02
    run_pass()

    held = [{"job_id": str(pk), "attempt": attempt, "state": "starting"}
            for pk, attempt in Job.objects.filter(node__name="gpu-02").values_list("pk", "attempt")]
    assert len(held) == 8
    one = heartbeat_queries(big, big_uuids, 1, held[:1])
    assert heartbeat_queries(big, big_uuids, 1, held) == one


def test_submit_queries_do_not_grow_with_the_users_jobs(demo, api):
    alice = api("alice")
    body = {"project": "vision", "name": "train", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}}

    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            r = alice.post("/api/v1/jobs/", body, format="json")
        assert r.status_code == 201, r.content
        return len(queries)

    count()  # the first submit fills per-process caches
    second = count()
    assert second <= 15
    for _ in range(10):
        count()
    assert count() == second
