"""The agent API's side of private images: a node gets the project's registry login only for the
image of an attempt it holds assigned or starting (never another node, another project, a stale or
running attempt), never through the launch message or the launch spec; the pull's progress is the
job's reason until it runs."""
import json

import pytest

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.jobs.services import job_submit
from portal.storage import secrets
from portal.storage.models import RegistryCredential
from scheduler.adapter import run_pass
from tests.conftest import agent_client

pytestmark = pytest.mark.django_db
REGISTRY = "registry.example.org:5000"
IMAGE = f"{REGISTRY}/team/train:1"
SECRET = "p@ss-not-for-jobs"


@pytest.fixture
def login(demo):
    return RegistryCredential.objects.create(project=demo.vision, registry=REGISTRY, username="ci",
                                             secret_encrypted=secrets.encrypt(SECRET))


@pytest.fixture
def node(demo):
    for project in (demo.vision, demo.nlp):  # the private images are allowed in both
        project.quota.allowed_images = [*project.quota.allowed_images, f"{REGISTRY}/team/*", "team/*"]
        project.quota.save()
    return agent_client(demo, "gpu-01")


def place(demo, user="alice", project="vision", image=IMAGE):
    job, _ = job_submit(actor=Actor(user=demo.users[user]), data={
        "project": project, "name": "p", "image": image, "command": ["true"], "resources": {"gpus": 1}})
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned", (job.state, job.reason_message)
    return job


def auth(node, job, attempt=None):
    return node.post(f"/api/agent/v1/jobs/{job.pk}/registry-auth", {"attempt": attempt or job.attempt}, format="json")


def test_the_node_starting_a_job_gets_its_projects_login_and_no_one_else_does(demo, node, login, sent,
                                                                              django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        job = place(demo)
    # Neither the launch message on the broker nor the confirmed spec carries it.
    assert sent and SECRET not in json.dumps(sent, default=str)
    confirmed = node.post(f"/api/agent/v1/jobs/{job.pk}/confirm", {"attempt": 1}, format="json")
    assert confirmed.status_code == 200 and SECRET not in confirmed.content.decode()

    r = auth(node, job)
    assert r.status_code == 200, r.content
    assert r.json() == {"registry": REGISTRY, "username": "ci", "password": SECRET}
    assert r["Cache-Control"] == "no-store"

    other = agent_client(demo, "gpu-02")
    assert auth(other, job).status_code == 409
    assert auth(node, job, attempt=2).status_code == 409
    node.post(f"/api/agent/v1/jobs/{job.pk}/events", {"attempt": 1, "state": "running"}, format="json")
    assert auth(node, job).status_code == 409  # a running attempt never pulls
    assert node.post("/api/agent/v1/jobs/999999/registry-auth", {"attempt": 1}, format="json").status_code == 409


def test_another_projects_job_with_the_same_image_gets_no_login(demo, node, login, settings):
    job = place(demo, user="charlie", project="nlp")
    r = auth(node, job)
    assert r.status_code == 200 and r.json() == {"registry": REGISTRY, "username": "", "password": ""}


def test_docker_hub_images_take_a_login_stored_under_any_of_its_names(demo, node):
    RegistryCredential.objects.create(project=demo.vision, registry="index.docker.io", username="hub",
                                      secret_encrypted=secrets.encrypt("hub-token"))
    r = auth(node, place(demo, image="team/private:2"))
    assert r.json() == {"registry": "docker.io", "username": "hub", "password": "hub-token"}


def test_a_login_that_cannot_be_decrypted_says_so(demo, node, login, settings):
    settings.SECRET_KEY = "another-key-" * 4
    body = auth(node, place(demo)).json()
    assert body["password"] == "" and "cannot be decrypted" in body["problem"] and "set it again" in body["problem"]


def test_pull_progress_is_the_jobs_reason_until_it_runs(demo, node, api):
    job = place(demo)
    node.post(f"/api/agent/v1/jobs/{job.pk}/confirm", {"attempt": 1}, format="json")
    r = node.post(f"/api/agent/v1/jobs/{job.pk}/progress",
                  {"attempt": 1, "stage": "pulling", "message": f"pulling image {IMAGE}: 43%"}, format="json")
    assert r.status_code == 200 and r.json() == {"result": "applied"}
    shown = api("alice").get(f"/api/v1/jobs/{job.pk}/").json()
    assert shown["state"] == "starting"
    assert shown["reason"] == {"code": "pulling", "message": f"pulling image {IMAGE}: 43%"}
    assert agent_client(demo, "gpu-02").post(f"/api/agent/v1/jobs/{job.pk}/progress", {
        "attempt": 1, "stage": "pulling", "message": "x"}, format="json").status_code == 409
    for bad in ({"attempt": 1, "stage": "mining", "message": "x"}, {"attempt": 1, "stage": "pulling", "message": 5},
                {"attempt": 1, "stage": "pulling", "message": "x" * 301}, {"attempt": 1, "stage": "pulling"}):
        r = node.post(f"/api/agent/v1/jobs/{job.pk}/progress", bad, format="json")
        assert r.status_code == 400, (bad, r.content)
    node.post(f"/api/agent/v1/jobs/{job.pk}/events", {"attempt": 1, "state": "running"}, format="json")
    shown = api("alice").get(f"/api/v1/jobs/{job.pk}/").json()
    assert shown["state"] == "running" and not shown["reason"]
    assert node.post(f"/api/agent/v1/jobs/{job.pk}/progress", {
        "attempt": 1, "stage": "pulling", "message": "late"}, format="json").status_code == 409
    assert Job.objects.get(pk=job.pk).reason_message == ""


@pytest.mark.parametrize("image, ok", [
    ("127.0.0.1:5000/team/x:1", True), ("registry.example.org:5000/team/train:1", True), ("localhost:5000/x", True),
    ("registry.example.org/team/x@sha256:" + "a" * 64, True), ("host:port/x:1", False), ("Reg.Example:5000/x", False),
    ("127.0.0.1:5000:1/x", False), ("127.0.0.1:5000/", False), (":5000/x", False),
])
def test_image_references_may_name_a_registry_port(image, ok):
    from portal.jobs.spec import IMAGE as IMAGE_REF

    assert bool(IMAGE_REF.match(image)) is ok
