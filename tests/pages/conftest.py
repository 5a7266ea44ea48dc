import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from portal.core.context import Actor
from portal.jobs.services import job_submit

IMAGE = "gpuportal/busybox:latest"


@pytest.fixture
def browser():
    """Client factory: browser("alice") is a logged-in session; csrf=True enforces CSRF like a real browser."""

    def make(username=None, csrf=False):
        client = Client(enforce_csrf_checks=csrf)
        if username:
            client.force_login(get_user_model().objects.get(username=username))
        return client

    return make


@pytest.fixture
def submit(demo):
    def make(user="alice", project="vision", **over):
        data = {"project": project, "name": "j", "image": IMAGE, "command": ["true"], **over}
        job, _ = job_submit(actor=Actor(user=demo.users[user]), data=data)
        return job

    return make
