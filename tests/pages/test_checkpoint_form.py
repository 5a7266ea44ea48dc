"""The submit page's checkpoint inputs: they become the spec's checkpoint, and the API's messages
about it come back next to them."""
import re

import pytest

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.jobs.services import template_save

pytestmark = pytest.mark.django_db
FORM = {"project": "vision", "name": "train", "image": "gpuportal/busybox:latest", "command": "python train.py",
        "priority": "normal", "sandbox": "docker", "time_limit": "1h"}


def test_the_form_submits_a_checkpointing_job(demo, browser):
    response = browser("alice").post("/jobs/new/", {**FORM, "checkpoint_signal": "SIGUSR2", "checkpoint_grace_s": "300"})
    job = Job.objects.get(name="train")
    assert response.status_code == 302 and job.checkpoint == {"signal": "SIGUSR2", "grace_s": 300}
    browser("alice").post("/jobs/new/", {**FORM, "name": "plain"})
    assert Job.objects.get(name="plain").checkpoint is None


def test_a_bad_grace_is_shown_next_to_its_input(demo, browser):
    page = browser("alice").post("/jobs/new/", {**FORM, "checkpoint_signal": "SIGUSR1",
                                                "checkpoint_grace_s": "600", "time_limit": "10m"}).content.decode()
    assert re.search(r'id="id_checkpoint_grace_s_error"><li>600 s is not under the job&#x27;s time limit of 600 s', page), page
    assert not Job.objects.exists()


def test_the_form_keeps_a_save_interval_and_a_template_brings_it_back(demo, browser):
    browser("alice").post("/jobs/new/", {**FORM, "checkpoint_signal": "SIGUSR1", "checkpoint_interval_s": "900"})
    job = Job.objects.get(name="train")
    assert job.checkpoint == {"signal": "SIGUSR1", "grace_s": 120, "interval_s": 900}
    assert "saves every 900 s" in browser("alice").get(f"/jobs/{job.pk}/").content.decode()
    template = template_save(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="ckpt", locked=[],
                             spec={"image": job.image, "command": ["true"], "checkpoint": job.checkpoint})
    page = browser("alice").get(f"/jobs/new/?template={template.pk}").content.decode()
    assert re.search(r'name="checkpoint_interval_s"[^>]*value="900"', page), page


def test_a_bad_interval_is_shown_next_to_its_input(demo, browser):
    page = browser("alice").post("/jobs/new/", {**FORM, "checkpoint_signal": "SIGUSR1",
                                                "checkpoint_interval_s": "-5"}).content.decode()
    assert 'id="id_checkpoint_interval_s_error"' in page, page
    assert not Job.objects.exists()
