"""A job's environment is its owner's: others in the project do not read it or reuse it (issue 12).

alice owns vision, bob is a member, dave a viewer; admin is staff.
"""
import pytest

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.jobs.services import job_submit

SECRET = {"WANDB_API_KEY": "s3cret"}


def _job(user, **over):
    job, _ = job_submit(actor=Actor(user=user), data={
        "project": "vision", "name": "train", "image": "gpuportal/busybox:latest", "command": ["true"],
        "env": SECRET, **over})
    return job


@pytest.mark.parametrize("owner,reader,sees", [
    ("alice", "alice", True),  # their own
    ("alice", "bob", False),  # a member
    ("alice", "dave", False),  # a viewer
    ("alice", "admin", True),  # staff
    ("bob", "alice", True),  # a project owner reads a member's
    ("bob", "bob", True),
])
def test_env_is_shown_to_its_owner_and_project_managers_only(demo, api, owner, reader, sees):
    job = _job(demo.users[owner])
    client = api(reader)
    expected = SECRET if sees else None
    assert client.get(f"/api/v1/jobs/{job.pk}/").json()["env"] == expected
    listed = {j["id"]: j for j in client.get("/api/v1/jobs/").json()["results"]}
    assert listed[job.pk]["env"] == expected
    if not sees:
        assert "s3cret" not in client.get(f"/jobs/{job.pk}/").content.decode()


def test_resubmit_by_someone_else_drops_the_environment(demo, api):
    job = _job(demo.users["alice"])
    Job.objects.filter(pk=job.pk).update(state="failed")
    r = api("bob").post(f"/api/v1/jobs/{job.pk}/resubmit/")
    assert r.status_code == 201 and r.json()["env"] == {}
    assert Job.objects.get(pk=r.json()["id"]).env == {}
    # A project owner resubmitting a member's job: the same.
    bobs = _job(demo.users["bob"])
    Job.objects.filter(pk=bobs.pk).update(state="failed")
    r = api("alice").post(f"/api/v1/jobs/{bobs.pk}/resubmit/")
    assert r.status_code == 201 and Job.objects.get(pk=r.json()["id"]).env == {}
    # The owner's own resubmit keeps it.
    r = api("alice").post(f"/api/v1/jobs/{job.pk}/resubmit/")
    assert r.status_code == 201 and r.json()["env"] == SECRET


def test_resubmit_page_says_the_environment_was_dropped(demo, client):
    job = _job(demo.users["alice"])
    Job.objects.filter(pk=job.pk).update(state="failed")
    client.force_login(demo.users["bob"])
    response = client.post(f"/jobs/{job.pk}/resubmit/", follow=True)
    new = Job.objects.exclude(pk=job.pk).get(resubmit_of=job)
    assert new.env == {} and new.user.username == "bob"
    assert "without its environment" in response.content.decode()
