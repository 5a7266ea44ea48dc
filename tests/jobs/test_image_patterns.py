"""A project's allowed images are references or shell-style patterns (`registry.example.org/team/*`):
every way to submit refuses an image matching none with a 400 on `image` naming the patterns."""
import re

import pytest

from portal.jobs.models import Job
from portal.tenancy.models import Quota

PATTERNS = ["registry.example.org/team/*", "gpuportal/busybox:latest"]


@pytest.fixture
def alice(demo, api):
    Quota.objects.filter(project=demo.vision).update(allowed_images=PATTERNS)
    return api("alice")


def body(image):
    return {"project": "vision", "image": image, "command": ["true"]}


@pytest.mark.parametrize("image", ["registry.example.org/team/train:1", "registry.example.org/team/sub/x",
                                   "gpuportal/busybox:latest"])
def test_an_image_matching_a_pattern_is_accepted(alice, image):
    r = alice.post("/api/v1/jobs/", body(image), format="json")
    assert r.status_code == 201, r.content
    assert r.json()["image"] == image


@pytest.mark.parametrize("image", ["registry.example.org/other/x:1", "registry.example.org/team",
                                   "registry.example.org/teams/x", "gpuportal/busybox:1.36",
                                   "evil.org/registry.example.org/team/x"])
def test_an_image_matching_none_is_refused_naming_the_patterns(alice, image):
    r = alice.post("/api/v1/jobs/", body(image), format="json")
    assert r.status_code == 400, r.content
    message = r.json()["error"]["fields"]["image"][0]
    assert "not an allowed image" in message and "registry.example.org/team/*" in message
    assert not Job.objects.exists()


def test_a_batch_names_the_refused_job(alice):
    r = alice.post("/api/v1/jobs/batch/", {"defaults": {"project": "vision", "command": ["true"]}, "jobs": [
        {"image": "registry.example.org/team/a:1"}, {"image": "docker.io/library/ubuntu"}]}, format="json")
    assert r.status_code == 400, r.content
    assert set(r.json()["error"]["fields"]) == {"jobs[1].image"}
    assert not Job.objects.exists()


def test_a_resubmit_after_the_patterns_narrowed_is_refused(alice, demo):
    job = alice.post("/api/v1/jobs/", body("registry.example.org/team/a:1"), format="json").json()
    Quota.objects.filter(project=demo.vision).update(allowed_images=["gpuportal/*"])
    r = alice.post(f"/api/v1/jobs/{job['id']}/resubmit/")
    assert r.status_code == 400, r.content
    assert "gpuportal/*" in r.json()["error"]["fields"]["image"][0]


def test_the_submit_page_refuses_it_on_the_image_field(alice, demo, client):
    client.force_login(demo.users["alice"])
    page = client.post("/jobs/new/", {"project": "vision", "name": "train", "image": "docker.io/library/ubuntu",
                                      "command": "true", "priority": "normal", "sandbox": "docker"}).content.decode()
    assert re.search(r'id="id_image_error"><li>docker.io/library/ubuntu is not an allowed image[^<]*'
                     r'registry.example.org/team/\*', page), page[:2000]
    assert not Job.objects.exists()


def test_no_patterns_allow_any_image(alice, demo):
    Quota.objects.filter(project=demo.vision).update(allowed_images=[])
    r = alice.post("/api/v1/jobs/", body("docker.io/library/ubuntu:24.04"), format="json")
    assert r.status_code == 201, r.content


def test_members_read_the_patterns_and_only_staff_set_them(demo, api, alice):
    assert api("bob").get("/api/v1/projects/vision/").json()["quota"]["allowed_images"] == PATTERNS
    assert alice.patch("/api/v1/projects/vision/quota/", {"allowed_images": ["x/*"]}, format="json").status_code == 403
    staff = api("admin")
    r = staff.patch("/api/v1/projects/vision/quota/", {"allowed_images": ["ghcr.io/acme/*", "a b"]}, format="json")
    assert r.status_code == 400 and "allowed_images" in str(r.json()["error"]["fields"]), r.content
    r = staff.patch("/api/v1/projects/vision/quota/", {"allowed_images": ["ghcr.io/acme/*"]}, format="json")
    assert r.status_code == 200 and r.json()["allowed_images"] == ["ghcr.io/acme/*"]
