"""Personas used across the suite (every area tests its endpoints against an outsider):

admin (staff); acme/vision: alice owner, bob member, dave viewer;
globex/nlp: charlie owner, the outsider to everything of acme.
"""
import os

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from portal.accounts.services import token_issue
from portal.core.context import Actor
# The pinned wall clock: the `clock` fixture and marker, --clock-instants (see tests/clock.py).
from tests.clock import (clock, pytest_addoption, pytest_collection_modifyitems, pytest_configure,  # noqa: F401
                         pytest_generate_tests)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """Seed the personas once per session: tests that roll back keep them; a transactional
    test flushes the database, and `demo` seeds again after it."""
    with django_db_blocker.unblock():
        call_command("seed_demo", stdout=open(os.devnull, "w"))


@pytest.fixture
def demo(db):
    from django.contrib.auth import get_user_model

    if not get_user_model().objects.filter(username="charlie").exists():
        call_command("seed_demo", stdout=open(os.devnull, "w"))

    from portal.tenancy.models import Project

    users = {u.username: u for u in get_user_model().objects.all()}
    return type("Demo", (), {
        "users": users,
        "vision": Project.objects.get(slug="vision"),
        "nlp": Project.objects.get(slug="nlp"),
    })


IMAGE = "gpuportal/busybox:latest"


def submit(demo, user="alice", project="vision", **over):
    """Submit a one-command job as `user` (a persona of `demo`); `over` changes the spec."""
    from portal.jobs.services import job_submit

    data = {"project": project, "name": "j", "image": IMAGE, "command": ["true"], **over}
    job, _ = job_submit(actor=Actor(user=demo.users[user]), data=data)
    return job


@pytest.fixture
def sent(monkeypatch):
    """The commands the portal publishes to node queues, as (task, node, args), instead of the broker."""
    calls = []
    monkeypatch.setattr("scheduler.dispatch._send", lambda task, node, args, **kw: calls.append((task, node, args)))
    return calls


@pytest.fixture
def passes_here(monkeypatch):
    """Pass requests go nowhere: the test runs its scheduling passes itself (run_pass)."""
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: None)


def agent_client(demo, name="gpu-01", gpus="2xH100-80GB", **node):
    """A new node added by the admin, and an APIClient holding its agent token (client.node)."""
    from portal.nodes.services import node_add

    added, secret = node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus=gpus, **node)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    client.node = added
    return client


def make_token(user, scopes=("read", "submit", "admin"), project=None, **kwargs) -> str:
    _, secret = token_issue(actor=Actor(user=user), user=user, name="test", scopes=list(scopes),
                            project=project, **kwargs)
    return secret


@pytest.fixture
def api():
    """APIClient factory: api("alice") logs in by session; api(token="gpp_...") uses a Bearer token."""

    def make(username=None, token=None):
        client = APIClient()
        if username:
            from django.contrib.auth import get_user_model

            client.force_login(get_user_model().objects.get(username=username))
        if token:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        return client

    return make


@pytest.fixture(autouse=True)
def volumes_root(settings, tmp_path):
    """Each test gets its own volumes root (the operator's shared tree, docs/storage.md)."""
    settings.VOLUMES_ROOT = tmp_path / "volumes"
    return settings.VOLUMES_ROOT


@pytest.fixture(autouse=True)
def _clear_cache():
    """Throttle counters live in the cache (Redis in CI): each test starts from zero."""
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture(autouse=True)
def _drop_buffered_samples():
    """GPU samples buffered by a test's heartbeats must not leak into the next test (or be
    flushed at exit into a test database that no longer exists)."""
    yield
    from portal.metrics.services import BUFFER

    BUFFER.drain()


@pytest.fixture
def http_files(tmp_path):
    """A real HTTP server on loopback serving a fresh folder (tests/httpfiles.py); stopped afterwards."""
    from tests.httpfiles import FileServer

    folder = tmp_path / "served"
    folder.mkdir()
    server = FileServer(folder)
    yield server
    server.stop()
