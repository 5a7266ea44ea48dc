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
    ({"resources": {"gpus": 2, "nodes": 0}}, "resources.nodes"),
    ({"resources": {"gpus": 2, "nodes": 1.5}}, "resources.nodes"),
    ({"resources": {"gpus": 0.5, "nodes": 2}}, "resources.nodes"),
    ({"resources": {"nodes": 2}}, "resources.nodes"),
    ({"resources": {"gpus": 3, "nodes": 2}}, "resources.gpus"),
    ({"resources": {"gpus": 6, "nodes": 2, "gpus_per_node": 2}}, "resources.gpus"),
    ({"resources": {"nodes": 2, "gpus_per_node": 0}}, "resources.gpus_per_node"),
    ({"resources": {"nodes": 2, "gpus_per_node": 9}}, "resources.gpus"),
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
    assert {"image", "command"} <= set(r.json()["error"]["fields"])
    assert "name" not in r.json()["error"]["fields"]  # optional: the command's program names the job


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
    # The same request, its keys in another order: a retry.
    again = submit(alice, dict(reversed(list(spec().items()))), HTTP_IDEMPOTENCY_KEY="k-1")
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert Job.objects.count() == 1


@pytest.mark.parametrize("body", [
    spec(name="different"),  # another job
    spec(resources={"gpus": 99}),  # an invalid one
    spec(project="nlp"),  # another tenant's project
], ids=["different", "invalid", "other-tenant"])
def test_idempotency_key_reused_with_another_body_is_refused(alice, body):
    """M4: a used key with any other body answered 200 and the first job."""
    first = submit(alice, spec(), HTTP_IDEMPOTENCY_KEY="k-1")
    again = submit(alice, body, HTTP_IDEMPOTENCY_KEY="k-1")
    assert again.status_code == 422, again.content
    error = again.json()["error"]
    assert error["code"] == "idempotency_key_reused" and "Idempotency-Key" in error["fields"]
    assert "id" not in again.json() and first.status_code == 201
    assert Job.objects.count() == 1


def test_idempotency_key_is_scoped_to_the_caller(demo, api):
    """Per user, and per token restriction: a token restricted to another project got a 500
    (Job.DoesNotExist) reusing a key, and must not see the first job either."""
    from portal.tenancy.models import Organization
    from portal.tenancy.services import membership_add, project_create
    from portal.core.context import Actor
    from tests.conftest import make_token

    staff = Actor(user=demo.users["admin"])
    audio = project_create(actor=staff, organization=Organization.objects.get(slug="acme"), slug="audio", name="A")
    membership_add(actor=staff, project=audio, username="alice", role="owner")
    first = submit(api("alice"), spec(), HTTP_IDEMPOTENCY_KEY="k-1")
    restricted = api(token=make_token(demo.users["alice"], ["read", "submit"], project=audio))
    for body in (spec(), spec(project="audio")):
        again = submit(restricted, body, HTTP_IDEMPOTENCY_KEY="k-1")
        assert again.status_code == 422, again.content
    # Another person's key of the same name is theirs alone.
    bobs = submit(api("bob"), spec(), HTTP_IDEMPOTENCY_KEY="k-1")
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]


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


@pytest.mark.parametrize("name", ["ld_preload", "Ld_Library_Path", "cuda_visible_devices", "nvidia_driver_capabilities",
                                  "gpuportal_job_id", "master_addr", "World_Size"])
def test_reserved_env_names_are_refused_in_any_case(alice, name):
    """`ld_preload` was accepted at submit and silently dropped by the agent."""
    r = submit(alice, spec(env={name: "x"}))
    assert r.status_code == 400 and "is reserved" in r.json()["error"]["fields"]["env"][0]
    assert Job.objects.count() == 0


@pytest.mark.parametrize("value", ["a\nB=1", "a\r\nb", "a\x00b", "\n"])
def test_env_values_are_single_lines(alice, value):
    r = submit(alice, spec(env={"OK": "fine", "EVIL": value}))
    assert r.status_code == 400, r.content
    fields = r.json()["error"]["fields"]
    assert list(fields) == ["env.EVIL"] and "A value may not hold NUL or line breaks." in fields["env.EVIL"]
    assert Job.objects.count() == 0
    assert submit(alice, spec(env={"TABS": "a\tb", "RANK": "0"})).status_code == 201


@pytest.mark.parametrize("name", ["train\u202egpj.sh", "a\u200bb", "bell\x07", "line\nbreak", "bom\ufeff"])
def test_names_refuse_control_and_format_characters(demo, api, alice, name):
    """Right-to-left overrides and zero-width characters made names lie."""
    r = submit(alice, spec(name=name))
    assert r.status_code == 400 and "name" in r.json()["error"]["fields"], r.content
    r = alice.post("/api/v1/job-templates/", data={"project": "vision", "name": name, "spec": {}}, format="json")
    assert r.status_code == 400 and "name" in r.json()["error"]["fields"], r.content
    r = alice.patch("/api/v1/projects/vision/", data={"name": name}, format="json")
    assert r.status_code == 400 and "name" in r.json()["error"]["fields"], r.content
    r = api("admin").post("/api/v1/projects/", data={"organization": "acme", "slug": "p2", "name": name},
                          format="json")
    assert r.status_code == 400 and "name" in r.json()["error"]["fields"], r.content
    r = api("admin").post("/api/v1/organizations/", data={"slug": "o2", "name": name}, format="json")
    assert r.status_code == 400 and "name" in r.json()["error"]["fields"], r.content
    r = alice.post("/api/v1/tokens/", data={"name": name, "scopes": ["read"]}, format="json")
    assert r.status_code == 400 and "name" in r.json()["error"]["fields"], r.content
    assert Job.objects.count() == 0 and not JobTemplate.objects.exists()
    # Letters of any script, and emoji, stay welcome.
    assert submit(alice, spec(name="entraînement-训练-🚀")).status_code == 201


@pytest.fixture
def two_nodes(demo):
    from portal.core.context import Actor
    from portal.nodes.services import node_add

    for name in ("gpu-01", "gpu-02"):
        node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus="4xH100-80GB")


def test_a_multi_node_job_stores_its_nodes_and_shows_gpus_per_node(alice, two_nodes):
    r = submit(alice, spec(resources={"nodes": 2, "gpus_per_node": 4}))
    assert r.status_code == 201, r.content
    res = r.json()["resources"]
    assert (res["gpus"], res["nodes"], res["gpus_per_node"]) == (8, 2, 4)
    assert Job.objects.get(pk=r.json()["id"]).nodes == 2
    r = submit(alice, spec(resources={"gpus": 8, "nodes": 2}))  # gpus_per_node follows from gpus
    assert r.status_code == 201 and r.json()["resources"]["gpus_per_node"] == 4
    r = submit(alice, spec(resources={"gpus": 2}))  # no nodes: one node, all its GPUs there
    assert r.json()["resources"]["nodes"] == 1 and r.json()["resources"]["gpus_per_node"] == 2


@pytest.mark.parametrize("resources,field,message", [
    ({"gpus": 8}, "resources.gpus", "8 GPUs on one node, but the largest node has 4 GPUs; to span nodes ask for "
                                    "nodes and gpus_per_node (e.g. nodes 2)."),
    ({"nodes": 3, "gpus_per_node": 1}, "resources.nodes", "3 exceeds the 2 node(s) with GPUs in the cluster."),
    ({"nodes": 2, "gpus_per_node": 6}, "resources.gpus_per_node", "6 exceeds the largest node's 4 GPUs."),
    ({"nodes": 2, "gpus_per_node": 2, "gpu_type": "H100-80GB"}, None, None),
])
def test_a_job_no_set_of_nodes_could_hold_is_refused_naming_the_field(alice, two_nodes, resources, field, message):
    r = submit(alice, spec(resources=resources))
    if field is None:
        assert r.status_code == 201, r.content
        return
    assert r.status_code == 400 and r.json()["error"]["fields"][field] == [message]
    assert not Job.objects.exists()


def test_a_template_carries_nodes_and_refuses_a_bad_split(demo, api, two_nodes):
    client = api("alice")
    r = client.post("/api/v1/job-templates/", data={"project": "vision", "name": "ddp", "spec": {
        "image": IMAGE, "resources": {"nodes": 2, "gpus_per_node": 5}}}, format="json")  # nodes have 4
    assert r.status_code == 400
    assert r.json()["error"]["fields"]["spec.resources.gpus_per_node"] == ["5 exceeds the largest node's 4 GPUs."]
    r = client.post("/api/v1/job-templates/", data={"project": "vision", "name": "ddp", "spec": {
        "image": IMAGE, "resources": {"nodes": 2, "gpus_per_node": 2}}}, format="json")
    assert r.status_code == 201, r.content
    r = submit(client, {"project": "vision", "template": "ddp", "name": "run", "command": ["torchrun", "t.py"]})
    assert r.status_code == 201, r.content
    assert (r.json()["resources"]["nodes"], r.json()["resources"]["gpus"]) == (2, 4)


def test_the_submit_answer_is_the_stored_job(demo, alice, api):
    """The answer is serialized from the job just stored, not read back (issue 14): it must say
    what a read of the job says, for a plain job, one with dependencies and one from a template."""
    JobTemplate.objects.create(project=demo.vision, name="tpl", spec={"image": IMAGE, "command": ["true"]},
                               locked=[])
    first = submit(alice, spec()).json()
    bodies = [first, submit(alice, spec(depends_on=[first["id"]])).json(),
              submit(alice, {"project": "vision", "name": "t", "template": "tpl", "env": {"K": "v"}}).json()]
    assert bodies[1]["depends_on"] == [first["id"]] and bodies[2]["template"] == "tpl"
    for body in bodies:
        read = alice.get(f"/api/v1/jobs/{body['id']}/").json()
        read.pop("events")
        assert body == read
    # The environment is the owner's: a member reading the same job does not see it.
    assert bodies[2]["env"] == {"K": "v"} and api("bob").get(f"/api/v1/jobs/{bodies[2]['id']}/").json()["env"] is None


def test_a_plain_submit_costs_few_queries(demo, api, django_assert_max_num_queries):
    """Token, project with the caller's role, the job, its audit record, the transaction: nothing
    read back, no dependency or cluster-size read for a one-node, one-GPU job (issue 14). A
    GPU-hour budget adds its read of the month's usage and the open allocations (one statement on
    PostgreSQL, which sums them; two on SQLite)."""
    from django.db import connection

    from portal.accounts.services import token_issue
    from portal.core.context import Actor

    _, secret = token_issue(actor=Actor(user=demo.users["alice"]), user=demo.users["alice"], name="cli",
                            scopes=["read", "submit"])
    client = api(token=secret)
    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=None)
    submit(client, spec())  # warm: the content types guardian reads are cached per process
    with django_assert_max_num_queries(6):
        assert submit(client, spec(resources={"gpus": 1})).status_code == 201
    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=1000)
    with django_assert_max_num_queries(7 if connection.vendor == "postgresql" else 8):
        assert submit(client, spec(resources={"gpus": 1})).status_code == 201
