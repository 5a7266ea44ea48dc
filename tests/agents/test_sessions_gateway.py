"""The agent's session gateway on its own (agents/sessions.py): the secret, the HTTP app's own
root, what it reports to the portal, and a sandbox that cannot publish sessions (kvm)."""
import http.server
import threading

import pytest
import requests

from agents.sandbox import SandboxHandle
from agents.sessions import Gateway, SessionDriver
from tests.procs import wait_for

SECRET = "gateway-secret-0123456789"


class Reports:
    """Stands in for the agent's portal client: the gateway's reports, as sent."""

    def __init__(self):
        self.sent = []

    def _post(self, path, body):
        self.sent.append((path, body))
        return {}


class App(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{self.path} prefix={self.headers.get('X-Forwarded-Prefix')} " \
               f"secret={self.headers.get('X-Gpuportal-Session-Secret')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def app():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), App)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def gateway():
    reports = Reports()
    gw = Gateway(listen="127.0.0.1:0", client=reports, ready_timeout_s=5).start()
    gw.reports = reports
    yield gw
    gw.stop()


def test_only_the_secret_opens_a_session_and_an_http_app_sees_its_own_root(gateway, app):
    session = {"name": "web", "kind": "http", "port": app, "secret": SECRET, "base_url": "/sessions/7/web/"}
    gateway.publish("7", 1, [session], {"web": ("tcp", "127.0.0.1", app)})
    url = gateway.url + "/sessions/7/web/a/b?x=1"
    assert requests.get(url).status_code == 404
    assert requests.get(url, headers={"X-Gpuportal-Session-Secret": "nope"}).status_code == 404
    assert requests.get(gateway.url + "/sessions/8/web/", headers={"X-Gpuportal-Session-Secret": SECRET}).status_code == 404
    r = requests.get(url, headers={"X-Gpuportal-Session-Secret": SECRET})
    # The app gets its own path, the prefix it is served under, and never the secret header.
    assert r.status_code == 200 and r.text == "/a/b?x=1 prefix=/sessions/7/web secret=None"
    wait_for(lambda: ("/jobs/7/sessions", {"attempt": 1, "name": "web", "state": "running",
                                           "gateway_url": gateway.url, "message": ""}) in gateway.reports.sent,
             10, "the running report")
    gateway.withdraw("7")
    assert gateway.reports.sent[-1] == ("/jobs/7/sessions", {"attempt": 1, "name": "web", "state": "ended",
                                                             "gateway_url": "", "message": ""})
    assert requests.get(url, headers={"X-Gpuportal-Session-Secret": SECRET}).status_code == 404


def test_an_app_that_never_listens_is_reported_with_a_reason(gateway):
    gateway.ready_timeout_s = 0.5
    session = {"name": "web", "kind": "http", "port": 1, "secret": SECRET, "base_url": "/sessions/9/web/"}
    gateway.publish("9", 2, [session], {"web": ("tcp", "127.0.0.1", 1)})
    wait_for(lambda: any(b["state"] == "starting" and "did not listen" in b["message"]
                         for _, b in gateway.reports.sent), 10, "the starting report")
    r = requests.get(gateway.url + "/sessions/9/web/", headers={"X-Gpuportal-Session-Secret": SECRET})
    assert r.status_code == 502


def test_a_sandbox_without_sessions_says_so_and_runs_the_job(gateway):
    class NoSessions:  # a driver that publishes nothing (the kvm driver before its terminal)
        name = "kvm"

        def launch(self, spec):
            return SandboxHandle(driver="kvm", ref="r", job_id=spec.job_id, attempt=spec.attempt, started_at=0.0)

        def remove(self, handle):
            self.removed = handle

    from agents.sandbox import LaunchSpec

    inner = NoSessions()
    driver = SessionDriver(inner, gateway)
    driver.lease_s = 99.0  # set on the driver it wraps, as the agent does with its lease
    assert inner.lease_s == 99.0 and driver.name == "kvm"
    handle = driver.launch(LaunchSpec(job_id="5", attempt=1, image="i", command=["true"], sessions=[
        {"name": "lab", "kind": "jupyter", "port": None, "secret": SECRET, "base_url": "/sessions/5/lab/"}]))
    assert handle.job_id == "5"
    assert gateway.reports.sent == [("/jobs/5/sessions", {
        "attempt": 1, "name": "lab", "state": "starting", "gateway_url": "",
        "message": "the kvm sandbox cannot publish sessions"})]
    driver.remove(handle)
    assert inner.removed is handle
