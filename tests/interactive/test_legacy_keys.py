"""Sessions whose attempt was launched before per-attempt keys (migration 0004): their node and app
hold the session's secret itself. They stay reachable through the portal (no 503, no 404 from the
gateway), and the node that knows the old secret can make no later attempt's key."""
import importlib
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from django.apps import apps
from django.db import connection
from django.utils import timezone

from agents.sessions import SECRET_HEADER, Gateway
from portal.core.context import Actor
from portal.interactive.models import Session, attempt_secret
from portal.interactive.proxy import _load
from portal.interactive.selectors import launch_sessions
from portal.interactive.services import session_report
from portal.jobs.models import Job, JobState
from portal.jobs.services import job_submit
from tests.conftest import make_token

# The proxy's _load starts with close_old_connections(), as every ASGI request does: outside a test's
# transaction, as in production.
pytestmark = pytest.mark.django_db(transaction=True)

adopt = importlib.import_module("portal.interactive.migrations.0004_session_legacy_key").adopt_legacy_keys


@pytest.fixture(autouse=True)
def no_dispatch(monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)


class _Editor:
    connection = connection


def web_job(demo, *, launched_at):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "image": "gpuportal/busybox:latest", "command": ["sleep", "1d"],
        "ports": [{"name": "web", "kind": "http", "port": 8000}]})
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, state_changed_at=launched_at)
    job.refresh_from_db()
    return job


@pytest.fixture
def app_server():
    """An HTTP app on the loopback, as a job's would listen."""
    class Hello(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello from the app")

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def gateway():
    gw = Gateway(listen="127.0.0.1:0").start()
    yield gw
    gw.stop()


def test_a_session_launched_before_per_attempt_keys_stays_reachable(demo, app_server, gateway):
    long_ago = timezone.now() - timedelta(days=30)
    job = web_job(demo, launched_at=long_ago)
    old = Session.objects.get(job=job)
    # As it stood before 0003: the node got the secret itself and reported (gateway_attempt 0).
    Session.objects.filter(pk=old.pk).update(state="running", gateway_url=gateway.url, gateway_attempt=0)
    gateway.publish(str(job.pk), 1, [{"name": "web", "kind": "http", "port": 8000, "secret": old.secret,
                                      "base_url": old.path}], {"web": ("tcp", "127.0.0.1", app_server)})
    fresh = web_job(demo, launched_at=timezone.now())  # launched with its per-attempt key: untouched
    fresh_secret = Session.objects.get(job=fresh).secret

    adopt(apps, _Editor())
    adopt(apps, _Editor())  # twice is once

    s = Session.objects.get(pk=old.pk)
    assert (s.legacy_key, s.legacy_attempt, s.gateway_attempt) == (old.secret, 1, 1)
    assert s.secret != old.secret
    assert Session.objects.get(job=fresh).secret == fresh_secret and not Session.objects.get(job=fresh).legacy_key
    alice = {b"authorization": f"Bearer {make_token(demo.users['alice'])}".encode()}
    info = _load(alice, str(job.pk), "web")
    assert (info["gateway"], info["secret"], info["state"]) == (gateway.url, old.secret, "running")
    # What the proxy sends, the gateway that holds the old secret accepts; its key from before 0004 it refuses.
    url = f"{gateway.url}{s.path}"
    r = requests.get(url, headers={SECRET_HEADER: info["secret"]}, timeout=10)
    assert (r.status_code, r.text) == (200, "hello from the app")
    assert requests.get(url, headers={SECRET_HEADER: attempt_secret(old.secret, 1)}, timeout=10).status_code == 404
    # A resent launch of that attempt carries the same key; its node re-reporting keeps it.
    assert launch_sessions([job.pk])[job.pk][0]["secret"] == old.secret
    session_report(node=None, job=job, attempt=1, name="web", state="running", gateway_url=gateway.url)
    assert _load(alice, str(job.pk), "web")["secret"] == old.secret

    # The next attempt gets a key made from the new secret: the old node cannot make it.
    Job.objects.filter(pk=job.pk).update(attempt=2)
    info = _load(alice, str(job.pk), "web")
    assert info["gateway"] == "" and info["secret"] == attempt_secret(s.secret, 2) != attempt_secret(old.secret, 2)
    assert launch_sessions([job.pk])[job.pk][0]["secret"] == info["secret"]


def test_a_queued_or_ended_job_keeps_its_secret(demo):
    """Only an attempt whose launch was sent holds the old secret; a queued one gets its own key at launch."""
    long_ago = timezone.now() - timedelta(days=30)
    queued = web_job(demo, launched_at=long_ago)
    Job.objects.filter(pk=queued.pk).update(state=JobState.QUEUED)
    ended = web_job(demo, launched_at=long_ago)
    Job.objects.filter(pk=ended.pk).update(state=JobState.SUCCEEDED)
    before = dict(Session.objects.values_list("job_id", "secret"))
    adopt(apps, _Editor())
    assert dict(Session.objects.values_list("job_id", "secret")) == before
    assert not Session.objects.exclude(legacy_key="").exists()
