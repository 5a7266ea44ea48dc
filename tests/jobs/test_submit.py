"""Every submit rule gives a field-level 4xx and stores nothing."""
from decimal import Decimal

import pytest

from portal.jobs.models import Job, JobTemplate
from portal.tenancy.models import Quota

IMAGE = "gpuportal/busybox:latest"


def spec(**over):
    base = {"project": "vision", "name": "train", "image": IMAGE, "command": ["python", "train.py"]}
    base.update(over)
    return base


def submit(client, body, **headers):
    return client.post("/api/v1/jobs/", data=body, format="json", **headers)


@pytest.fixture
def alice(demo, api):
    return api("alice")


def test_submit_stores_the_spec(alice):
    r = submit(alice, spec(env={"SEED": "1"}, resources={"gpus": 2, "gpu_type": "H100-80GB", "memory_mb": 8192},
                           time_limit="1-00:00:00", priority="high", preemptible=True))
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["state"] == "queued" and body["slurm_code"] == "PD" and body["attempt"] == 1
    assert body["resources"]["gpus"] == 2 and body["time_limit"] == 86400 and body["priority"] == "high"
    assert body["reason"]["code"] == "new"
    job = Job.objects.get(pk=body["id"])
    assert job.env == {"SEED": "1"} and job.user.username == "alice"


@pytest.mark.parametrize("over,field", [
    ({"image": "evil/miner:latest"}, "image"),
    ({"image": "NOT AN IMAGE"}, "image"),
    ({"resources": {"gpus": 17}}, "resources.gpus"),
    ({"resources": {"gpus": 0, "gpu_type": "H100-80GB"}}, "resources.gpu_type"),
    ({"resources": {"gpus": 0.3}}, "resources.gpus"),
    ({"resources": {"gpus": 1.5}}, "resources.gpus"),
    ({"resources": {"gpus": -1}}, "resources.gpus"),
    ({"resources": {"gpus": "two"}}, "resources.gpus"),
    ({"resources": {"gpus": 1, "gpu_memory_mb": 1000}}, "resources.gpu_memory_mb"),
    ({"resources": {"gpus": 1, "cores": 4}}, "resources.cores"),
    ({"time_limit": 8 * 86400}, "time_limit"),
    ({"time_limit": "forever"}, "time_limit"),
    ({"time_limit": 0}, "time_limit"),
    ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env"),
    ({"env": {"NVIDIA_VISIBLE_DEVICES": "all"}}, "env"),
    ({"env": {"LD_PRELOAD": "/x.so"}}, "env"),
    ({"env": {"MASTER_ADDR": "x"}}, "env"),
    ({"env": {"1BAD": "x"}}, "env"),
    ({"env": {"OK": 5}}, "env.OK"),
    ({"array": "0-1000000"}, "array"),
    ({"array": "5-1"}, "array"),
    ({"array": "0-9%0"}, "array"),
    ({"array": "a-b"}, "array"),
    ({"command": []}, "command"),
    ({"command": "rm -rf /"}, "command"),
    ({"command": ["ok", "nul\x00"]}, "command.1"),
    ({"name": "x" * 10000}, "name"),
    ({"network": True}, "network"),
    ({"priority": "urgent"}, "priority"),
    ({"sandbox": "chroot"}, "sandbox"),
    ({"state": "running"}, "state"),
    ({"user": "bob"}, "user"),
    ({"id": 7}, "id"),
    ({"depends_on": [999999]}, "depends_on"),
    ({"depends_on": ["x"]}, "depends_on.0"),
    ({"template": "nope"}, "template"),
    ({"project": "nlp"}, "project"),
    ({"project": "ghost"}, "project"),
])
def test_bad_submit_is_refused_with_field_message(alice, over, field):
    before = Job.objects.count()
    r = submit(alice, spec(**over))
    assert r.status_code == 400, r.content
    fields = r.json()["error"]["fields"]
    assert field in fields, fields
    assert Job.objects.count() == before


def test_messages_name_the_limit(alice):
    r = submit(alice, spec(resources={"gpus": 17}))
    assert r.json()["error"]["fields"]["resources.gpus"] == ["17 exceeds the project limit of 16."]
    r = submit(alice, spec(time_limit=8 * 86400))
    assert "604800" in r.json()["error"]["fields"]["time_limit"][0]


def test_missing_required_fields(alice):
    r = submit(alice, {"project": "vision"})
    assert r.status_code == 400
    assert {"name", "image", "command"} <= set(r.json()["error"]["fields"])


def test_viewer_cannot_submit(demo, api):
    r = submit(api("dave"), spec())
    assert r.status_code == 403
    assert not Job.objects.exists()


def test_dependency_on_another_projects_job_is_refused(demo, api):
    other = submit(api("charlie"), spec(project="nlp")).json()["id"]
    r = submit(api("alice"), spec(depends_on=[other]))
    assert r.status_code == 400 and "depends_on" in r.json()["error"]["fields"]


def test_dependency_on_failed_job_is_refused(alice):
    dep = submit(alice, spec()).json()["id"]
    Job.objects.filter(pk=dep).update(state="failed")
    r = submit(alice, spec(depends_on=[dep]))
    assert r.status_code == 400 and "already ended failed" in r.json()["error"]["fields"]["depends_on"][0]


@pytest.mark.clock
def test_budget_exhausted_is_409(demo, alice, clock):
    from portal.jobs.models import Allocation
    from portal.core.context import Actor
    from portal.nodes.services import node_add
    from datetime import timedelta

    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=Decimal("0.05"))  # 3 GPU-minutes a month
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    job = Job.objects.get(pk=submit(alice, spec(resources={"gpus": 1})).json()["id"])
    # Last month's GPU-hours do not count against this month's budget.
    Allocation.objects.create(job=job, attempt=1, gpu=node.gpus.get(),
                              started_at=clock.month_start - timedelta(hours=3), released_at=clock.month_start)
    assert submit(alice, spec(resources={"gpus": 1})).status_code == 201
    # This month's do: at least 5 minutes at every instant, 2 hours at most.
    Allocation.objects.create(job=job, attempt=2, gpu=node.gpus.get(), started_at=clock.ago_this_month(hours=2),
                              released_at=clock())
    before = Job.objects.count()
    r = submit(alice, spec(resources={"gpus": 1}))
    assert r.status_code == 409 and r.json()["error"]["code"] == "budget_exhausted"
    assert Job.objects.count() == before
    # CPU-only work is not held by a GPU-hour budget.
    assert submit(alice, spec()).status_code == 201


def test_array_creates_parent_and_tasks(alice):
    r = submit(alice, spec(array="0-9%3", resources={"gpus": 1}))
    assert r.status_code == 201
    parent = Job.objects.get(pk=r.json()["id"])
    assert parent.is_array_parent and parent.array_limit == 3
    tasks = list(parent.tasks.order_by("array_index"))
    assert [t.array_index for t in tasks] == list(range(10))
    assert all(t.array_limit == 3 and t.gpus == 1 for t in tasks)
    assert r.json()["tasks"] == {"queued": 10}
    listed = alice.get("/api/v1/jobs/?tasks=false").json()["results"]
    assert [j["id"] for j in listed] == [parent.pk]


def test_array_list_syntax(alice):
    r = submit(alice, spec(array="1,3,5-6"))
    assert sorted(Job.objects.get(pk=r.json()["id"]).tasks.values_list("array_index", flat=True)) == [1, 3, 5, 6]


def test_idempotency_key_returns_the_same_job(alice):
    first = submit(alice, spec(), HTTP_IDEMPOTENCY_KEY="k-1")
    again = submit(alice, spec(name="different"), HTTP_IDEMPOTENCY_KEY="k-1")
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert Job.objects.count() == 1


def test_template_fills_and_locks(demo, alice):
    JobTemplate.objects.create(project=demo.vision, name="std", spec={
        "image": IMAGE, "command": ["run"], "resources": {"gpus": 1}, "time_limit": 600}, locked=["image"])
    r = submit(alice, {"project": "vision", "name": "from-template", "template": "std"})
    assert r.status_code == 201, r.content
    assert r.json()["template"] == "std" and r.json()["time_limit"] == 600 and r.json()["command"] == ["run"]
    r = submit(alice, {"project": "vision", "name": "x", "template": "std", "image": "gpuportal/python:3.11"})
    assert r.status_code == 400
    assert r.json()["error"]["fields"] == {"image": ["Locked by template std; it cannot be overridden."]}
    r = submit(alice, {"project": "vision", "name": "x", "template": "std", "time_limit": 1200})
    assert r.status_code == 201 and r.json()["time_limit"] == 1200


def test_template_management_rules(demo, api):
    r = api("alice").post("/api/v1/job-templates/", data={"project": "vision", "name": "t", "spec": {"imag": "x"}},
                          format="json")
    assert r.status_code == 400 and "spec" in r.json()["error"]["fields"]
    r = api("alice").post("/api/v1/job-templates/", data={"project": "vision", "name": "t",
                                                          "spec": {"resources": {"gpus": 99}}}, format="json")
    assert r.status_code == 400 and "spec.resources.gpus" in r.json()["error"]["fields"]
    r = api("bob").post("/api/v1/job-templates/", data={"project": "vision", "name": "t", "spec": {}}, format="json")
    assert r.status_code == 403
    assert not JobTemplate.objects.exists()
