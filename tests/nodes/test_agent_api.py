"""The agent API: node tokens, registration, fencing, idempotent reports, reaper."""
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job, JobEvent, JobLogChunk
from portal.jobs.services import job_cancel, job_submit
from portal.nodes.models import GPU, Node
from portal.jobs.node_effects import nodes_reap
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import agent_client

IMAGE = "gpuportal/busybox:latest"
INVENTORY = [{"index": i, "uuid": f"GPU-real-{i}", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559,
              "pci_bus_id": f"0000:0{i}:00.0"} for i in range(2)]


@pytest.fixture
def node(demo):
    return agent_client(demo)


def post(client, path, body):
    return client.post(f"/api/agent/v1/{path}", data=body, format="json")


def register(client):
    return post(client, "register", {"name": "gpu-01", "cpus": 16, "memory_mb": 65536, "sandbox": "docker",
                                     "gpus": INVENTORY})


@pytest.fixture
def placed(node, demo, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    assert register(node).status_code == 200
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": IMAGE, "command": ["echo", "hi"], "resources": {"gpus": 1}})
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned"
    return job


def test_register_replaces_inventory(node):
    r = register(node)
    assert r.status_code == 200 and r.json()["node"] == "gpu-01" and r.json()["lease_s"] > 0
    gpus = list(GPU.objects.filter(node=node.node).order_by("index"))
    assert [g.uuid for g in gpus] == ["GPU-real-0", "GPU-real-1"]
    assert gpus[0].model == "H100-80GB" and gpus[0].pci_bus_id == "0000:00:00.0"
    assert Node.objects.get(pk=node.node.pk).last_heartbeat_at is not None


def test_token_is_bound_to_its_node(node):
    r = post(node, "register", {"name": "gpu-99", "cpus": 1, "memory_mb": 1, "sandbox": "docker", "gpus": []})
    assert r.status_code == 403


def test_bad_and_user_tokens_are_refused(demo):
    from tests.conftest import make_token

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {make_token(demo.users['admin'])}")
    assert post(client, "heartbeat", {}).status_code == 401
    client.credentials(HTTP_AUTHORIZATION="Bearer gpn_" + "x" * 42)
    assert post(client, "heartbeat", {}).status_code == 401


def test_node_token_is_refused_on_the_user_api(node):
    assert node.get("/api/v1/jobs/").status_code == 401


def test_lifecycle_through_reports(node, placed):
    r = post(node, f"jobs/{placed.pk}/confirm", {"attempt": 1})
    assert r.status_code == 200
    spec = r.json()["spec"]
    assert spec["command"] == ["echo", "hi"] and len(spec["gpu_uuids"]) == 1 and spec["gpu_uuids"][0].startswith("GPU-real")
    assert Job.objects.get(pk=placed.pk).state == "starting"
    assert post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "running"}).status_code == 200
    for _ in range(2):  # a retried chunk is stored once
        assert post(node, f"jobs/{placed.pk}/logs", {"attempt": 1, "offset": 0, "data": "hi\n"}).status_code == 200
    assert JobLogChunk.objects.filter(job=placed).count() == 1
    for _ in range(2):  # a retried terminal report is a no-op
        r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "failed", "exit_code": 3})
        assert r.status_code == 200
    job = Job.objects.get(pk=placed.pk)
    assert job.state == "failed" and job.exit_code == 3 and job.started_at and job.ended_at
    assert JobEvent.objects.filter(job=job, terminal=True).count() == 1
    assert not Allocation.objects.filter(job=job, released_at__isnull=True).exists()


def test_stale_attempt_is_409(node, placed):
    assert post(node, f"jobs/{placed.pk}/confirm", {"attempt": 2}).status_code == 409
    assert post(node, f"jobs/{placed.pk}/events", {"attempt": 0, "state": "running"}).status_code == 409
    assert post(node, "jobs/999999/confirm", {"attempt": 1}).status_code == 409


def test_cancelled_job_is_stopped_by_heartbeat(node, placed, demo):
    post(node, f"jobs/{placed.pk}/confirm", {"attempt": 1})
    job_cancel(actor=Actor(user=demo.users["alice"]), job=placed)
    r = post(node, "heartbeat", {"samples": [], "jobs": [{"job_id": str(placed.pk), "attempt": 1, "state": "running"}]})
    assert r.status_code == 200
    assert r.json()["stop"] == [{"job_id": str(placed.pk), "attempt": 1, "reason": "job is cancelled"}]
    # The agent's report of the stop is accepted as a duplicate end, not a second one.
    r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "cancelled"})
    assert r.status_code == 200 and r.json()["result"] == "duplicate"
    assert Job.objects.get(pk=placed.pk).state == "cancelled"


def test_heartbeat_says_drain(node):
    register(node)
    Node.objects.filter(name="gpu-01").update(state="draining")
    assert post(node, "heartbeat", {"samples": [], "jobs": []}).json() == {"drain": True, "stop": [], "refused": []}


@pytest.mark.clock
def test_silent_node_goes_down_and_its_job_is_requeued(node, placed, settings, clock):
    Node.objects.filter(pk=node.node.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=settings.NODE_TIMEOUT_S + 1))
    assert nodes_reap() == {"down": 1, "requeued": 1, "node_fail": 0}
    job = Job.objects.get(pk=placed.pk)
    assert job.state == "queued" and job.attempt == 2 and job.reason_code == "node_fail"
    assert Node.objects.get(pk=node.node.pk).state == "down"
    # The old attempt's reports are now stale; the node's return brings it back to ready.
    assert post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "running"}).status_code == 409
    register(node)
    assert Node.objects.get(pk=node.node.pk).state == "ready"


@pytest.mark.clock
def test_out_of_attempts_ends_node_fail(node, placed, settings, clock):
    Job.objects.filter(pk=placed.pk).update(attempt=settings.JOB_MAX_ATTEMPTS)
    Allocation.objects.filter(job=placed).update(attempt=settings.JOB_MAX_ATTEMPTS)
    Node.objects.filter(pk=node.node.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    assert nodes_reap()["node_fail"] == 1
    assert Job.objects.get(pk=placed.pk).state == "node_fail"


@pytest.mark.clock
def test_mass_silence_marks_nothing(demo, settings, clock):
    admin = Actor(user=demo.users["admin"])
    for i in range(4):
        node_add(actor=admin, name=f"n{i}", gpus="1xH100-80GB")
    Node.objects.update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    result = nodes_reap()
    assert result["down"] == 0 and result["suspected_portal_failure"] == 4
    assert not Node.objects.filter(state="down").exists()


def test_unenforceable_gpu_share_is_said_on_the_job(demo, api, monkeypatch):
    """A node without CUDA MPS cannot cap a fractional job: the API and the job page say so."""
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    client = agent_client(demo, "gpu-s", "1xA100-80GB", shared=True)
    node = client.node
    body = {"name": "gpu-s", "cpus": 8, "memory_mb": 65536, "sandbox": "docker",
            "gpus": [{"index": 0, "uuid": "GPU-s0", "model": "NVIDIA A100 80GB", "memory_mb": 81920}],
            "capabilities": {"mps": False}}
    assert post(client, "register", body).status_code == 200
    from portal.nodes.models import GPU as GPURow

    GPURow.objects.filter(node=node).update(mode="shared")
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "frac", "image": IMAGE, "command": ["true"], "resources": {"gpus": 0.25}})
    run_pass()
    detail = api("alice").get(f"/api/v1/jobs/{job.pk}/").json()
    assert detail["state"] == "assigned"
    assert len(detail["warnings"]) == 1 and "cannot enforce" in detail["warnings"][0]
    page = api("alice").get(f"/jobs/{job.pk}/")
    assert b"Not enforced:" in page.content
    # A node with MPS: nothing to warn about.
    assert post(client, "register", {**body, "capabilities": {"mps": True}}).status_code == 200
    assert api("alice").get(f"/api/v1/jobs/{job.pk}/").json()["warnings"] == []


def test_agent_reports_no_mps_for_simulated_gpus():
    from agents.probe import make_probe
    from agents.worker import capabilities

    assert capabilities(make_probe("sim:2xH100-80GB")) == {"mps": False, "simulated_gpus": True}


def test_a_gpu_the_agent_could_not_scrub_is_taken_out_of_service(node, placed, demo, settings):
    from portal.core.models import AuditEvent

    settings.GPU_HEALTH_AUTO_DRAIN = False  # a failed scrub drains regardless (docs/reliability.md rule 5)
    gpu = Allocation.objects.get(job=placed).gpu
    post(node, f"jobs/{placed.pk}/confirm", {"attempt": 1})
    r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "succeeded", "exit_code": 0, "scrub_failures": [
        {"gpu_index": gpu.index, "message": "memory scrub failed: CUDA_ERROR_ECC_UNCORRECTABLE"}]})
    assert r.status_code == 200
    placed.refresh_from_db()
    gpu.refresh_from_db()
    n = Node.objects.get(pk=node.node.pk)
    assert placed.state == "succeeded"  # the job's own outcome stands
    assert gpu.health == "unhealthy" and "Memory scrub failed after job" in gpu.health_reason
    assert "CUDA_ERROR_ECC_UNCORRECTABLE" in gpu.health_reason
    assert n.state == "drained" and "memory scrub failed on GPU" in n.state_reason
    assert AuditEvent.objects.filter(action="gpu.unhealthy", object_id=str(gpu.pk)).exists()
    # The scheduler places nothing there any more.
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "k", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}})
    run_pass()
    job.refresh_from_db()
    assert job.state == "queued"


def test_a_stale_report_still_takes_an_unscrubbed_gpu_out_of_service(node, placed):
    Job.objects.filter(pk=placed.pk).update(attempt=2)
    r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "cancelled", "scrub_failures": [
        {"gpu_index": 1, "message": "still used by process(es) 4242 after the job ended"}]})
    assert r.status_code == 409
    assert GPU.objects.get(node=node.node, index=1).health == "unhealthy"


@pytest.mark.parametrize("bad,field", [
    ([{"gpu_index": -1, "message": "x"}], "gpu_index"),
    ([{"gpu_index": 0}], "message"),
    ([{"gpu_index": 0, "message": "x", "extra": 1}], "extra"),
    ("GPU 0", "scrub_failures"),
])
def test_malformed_scrub_failures_are_a_400_that_changes_nothing(node, placed, bad, field):
    r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "failed", "scrub_failures": bad})
    assert r.status_code == 400 and field in str(r.json()["error"]["fields"])
    assert not GPU.objects.filter(node=node.node, health="unhealthy").exists()
    placed.refresh_from_db()
    assert placed.state == "assigned"


def test_a_sandbox_the_agent_could_not_kill_drains_its_node(node, placed, settings):
    settings.GPU_HEALTH_AUTO_DRAIN = False
    post(node, f"jobs/{placed.pk}/confirm", {"attempt": 1})
    problem = f"the sandbox of job {placed.pk} attempt 1 could not be killed"
    r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "cancelled", "message": "stopped; " + problem,
                                                 "node_problem": problem})
    assert r.status_code == 200
    placed.refresh_from_db()
    n = Node.objects.get(pk=node.node.pk)
    assert placed.state == "cancelled"
    assert n.state == "drained" and n.state_reason == f"Auto-drained: {problem}"
    # A second report (a retry) keeps the first reason; a too-long problem is a 400.
    assert post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "cancelled", "node_problem": "other"}
                ).status_code == 200
    assert Node.objects.get(pk=node.node.pk).state_reason == f"Auto-drained: {problem}"
    r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "cancelled", "node_problem": "x" * 501})
    assert r.status_code == 400 and "node_problem" in r.json()["error"]["fields"]


def test_a_job_its_node_could_not_start_is_requeued_not_failed(node, placed, settings):
    """The agent could not free or scrub the GPUs: not the job's fault. It goes back to the queue as a new
    attempt (or node_fail once out of attempts) and the node is drained."""
    post(node, f"jobs/{placed.pk}/confirm", {"attempt": 1})
    problem = "GPU(s) [0] could not be scrubbed before the job: 0: memory scrub failed: CUDA_ERROR_UNKNOWN"
    r = post(node, f"jobs/{placed.pk}/events", {"attempt": 1, "state": "failed", "message": problem,
                                                 "node_problem": problem,
                                                 "scrub_failures": [{"gpu_index": 0, "message": "CUDA_ERROR_UNKNOWN"}]})
    assert r.status_code == 200
    placed.refresh_from_db()
    assert placed.state == "queued" and placed.attempt == 2 and placed.reason_code == "node_fail"
    assert "could not start it" in placed.reason_message
    assert not Allocation.objects.filter(job=placed, released_at__isnull=True).exists()
    assert Node.objects.get(pk=node.node.pk).state == "drained"
    # The same on the last attempt ends it node_fail.
    settings.JOB_MAX_ATTEMPTS = 2
    Node.objects.filter(pk=node.node.pk).update(state="ready")
    GPU.objects.filter(node=node.node).update(health="healthy", health_reason="")
    run_pass()
    placed.refresh_from_db()
    assert placed.state == "assigned" and placed.attempt == 2
    post(node, f"jobs/{placed.pk}/confirm", {"attempt": 2})
    post(node, f"jobs/{placed.pk}/events", {"attempt": 2, "state": "failed", "node_problem": problem})
    placed.refresh_from_db()
    assert placed.state == "node_fail"


def test_register_keeps_each_gpus_topology_and_refuses_a_bad_one(node, api):
    inventory = [dict(g, topology={"nvlink": 0, "pcie": g["index"], "numa": None}) for g in INVENTORY]
    body = {"name": "gpu-01", "cpus": 16, "memory_mb": 65536, "sandbox": "docker", "gpus": inventory}
    assert post(node, "register", body).status_code == 200
    assert [g.topology for g in GPU.objects.filter(node=node.node).order_by("index")] == [
        {"nvlink": 0, "pcie": 0, "numa": None}, {"nvlink": 0, "pcie": 1, "numa": None}]
    r = api(token=None, username="admin").get(f"/api/v1/nodes/{node.node.name}/")
    assert r.status_code == 200 and r.json()["gpus"][1]["topology"] == {"nvlink": 0, "pcie": 1, "numa": None}
    for topology, field in (({"nvlink": -1}, "nvlink"), ({"switch": 3}, "switch"), ("nvlink", "topology")):
        r = post(node, "register", dict(body, gpus=[dict(inventory[0], topology=topology), inventory[1]]))
        assert r.status_code == 400 and field in str(r.json()["error"]["fields"]), r.json()
    assert GPU.objects.get(node=node.node, index=0).topology == {"nvlink": 0, "pcie": 0, "numa": None}


def test_the_simulated_probes_inventory_registers_with_its_topology(node):
    from agents.probe.sim import SimProbe

    gpus = [g.as_dict() for g in SimProbe("8xH100-80GB", node_name="gpu-01").inventory()]
    body = {"name": "gpu-01", "cpus": 16, "memory_mb": 65536, "sandbox": "docker", "gpus": gpus}
    assert post(node, "register", body).status_code == 200
    topo = [g.topology for g in GPU.objects.filter(node=node.node).order_by("index")]
    assert topo[3] == {"nvlink": 0, "pcie": 2, "numa": 0} and topo[4] == {"nvlink": 4, "pcie": 4, "numa": 1}


def test_a_confirmation_answers_the_spec_the_pass_published(node, placed, settings,
                                                             django_assert_max_num_queries):
    """The pass kept the spec it published (LAUNCH_SPEC_CACHE_S): the confirmation answers it
    without building it again (issue 14), the same spec the database gives; a stale attempt is
    still refused before any spec, and with the cache off the spec comes from the database."""
    from portal.launch import launch_specs

    built = launch_specs([("gpu-01", placed.pk)])[("gpu-01", placed.pk)]
    # node token, the job read, the transition (begin, update, event, commit): no spec query
    with django_assert_max_num_queries(6) as cached:
        r = post(node, f"jobs/{placed.pk}/confirm", {"attempt": 1})
    assert not any("interactive_session" in q["sql"] for q in cached.captured_queries)
    assert r.status_code == 200 and r.json()["spec"] == built
    assert post(node, f"jobs/{placed.pk}/confirm", {"attempt": 2}).status_code == 409

    # With the cache off nothing is kept, and a confirmation (a retry) builds the spec from the database.
    from django.core.cache import cache
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    settings.LAUNCH_SPEC_CACHE_S = 0
    cache.clear()
    launch_specs([("gpu-01", placed.pk)])
    with CaptureQueriesContext(connection) as queries:
        r = post(node, f"jobs/{placed.pk}/confirm", {"attempt": 1})
    assert r.status_code == 200 and r.json()["spec"] == built
    assert any("interactive_session" in q["sql"] for q in queries)  # the spec's sessions, read again
