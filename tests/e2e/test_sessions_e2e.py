"""Interactive sessions end to end (docs/sessions.md): JupyterLab and a terminal running in a
process sandbox behind the agent's session gateway, reached through the portal's ASGI proxy by
Chromium. One JupyterLab start serves the whole module; each test makes its job and sessions again
(the transactional tests flush the database between tests)."""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.e2e.conftest import PASSWORD, in_db_thread, shot
from portal.interactive.models import attempt_secret
from tests.conftest import make_token
from tests.procs import start_process, stop_process, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

JOB = 987001  # fixed: JupyterLab's base URL (/sessions/<job>/lab/) is set when it starts
BASE_SECRET = "test-session-secret-0123456789abcdef"  # the session's own; the node knows attempt 1's key
SECRET = attempt_secret(BASE_SECRET, 1)
LAB = f"/sessions/{JOB}/lab/"
SHELL = f"/sessions/{JOB}/sh/"
WEB = f"/sessions/{JOB}/web/"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The node's side: a process sandbox running JupyterLab from the venv, published on a gateway."""
    from agents.sandbox import LaunchSpec
    from agents.sandbox.process_driver import ProcessDriver
    from agents.sessions import Gateway, SessionDriver

    # A second app of the job: a plain HTTP server on the job's loopback (kind http).
    site = tmp_path_factory.mktemp("site")
    (site / "hello.txt").write_text("hello from the job\n")
    web_port = _free_port()
    web = start_process([sys.executable, "-m", "http.server", str(web_port), "--bind", "127.0.0.1"], cwd=site,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gateway = Gateway(listen="127.0.0.1:0").start()
    driver = SessionDriver(ProcessDriver(node="e2e-sessions", state_dir=str(tmp_path_factory.mktemp("agent"))),
                           gateway)
    driver.lease_s = 3600.0  # no agent renews the node's lease here: the job's supervisor must not fence it
    spec = LaunchSpec(job_id=str(JOB), attempt=1, image="local", command=[sys.executable, "-m", "jupyterlab"],
                      gpu_indexes=[0, 1], gpu_uuids=["GPU-sim-0", "GPU-sim-1"], sessions=[
                          {"name": "lab", "kind": "jupyter", "port": None, "secret": SECRET, "base_url": LAB},
                          {"name": "sh", "kind": "terminal", "port": None, "secret": SECRET, "base_url": SHELL},
                          {"name": "web", "kind": "http", "port": web_port, "secret": SECRET, "base_url": WEB}])
    handle = driver.launch(spec)
    try:
        target = driver.session_targets(handle, spec.sessions)["lab"]
        wait_for(lambda: _answers(target[1]), 120, "JupyterLab to answer on its socket")
        yield type("Node", (), {"gateway": gateway, "driver": driver, "handle": handle, "socket": target[1],
                                "web_port": web_port})
    finally:
        driver.remove(handle)
        gateway.stop()
        stop_process(web)


@pytest.fixture
def job(demo, node, e2e_settings):
    """alice's running job with its two sessions, reported running by the node."""
    from portal.interactive.services import session_report, sessions_create
    from portal.interactive.models import Session
    from portal.jobs.models import Job, JobState

    alice = demo.users["alice"]
    j = Job.objects.create(pk=JOB, project=demo.vision, user=alice, name="lab", image="local",
                           command=["jupyter", "lab"], time_limit_s=3600, state=JobState.RUNNING, gpus=2)
    sessions_create(j, [{"name": "lab", "kind": "jupyter"}, {"name": "sh", "kind": "terminal"},
                        {"name": "web", "kind": "http", "port": node.web_port}])
    Session.objects.filter(job=j).update(secret=BASE_SECRET)
    j.alice_token = make_token(alice)
    for name in ("lab", "sh", "web"):
        session_report(node=None, job=j, attempt=1, name=name, state="running", gateway_url=node.gateway.url)
    return j


def _answers(path: str) -> bool:
    try:
        return _unix_get(path, LAB + "api/status", token=SECRET)[0] == 200
    except OSError:  # not listening yet
        return False


def _unix_get(path: str, url: str, token: str | None = None) -> tuple[int, bytes]:
    """GET straight to the app's unix socket, as another process on the node could."""

    class Conn(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(path)

    conn = Conn("localhost", timeout=10)
    conn.request("GET", url, headers={"Authorization": f"token {token}"} if token else {})
    resp = conn.getresponse()
    return resp.status, resp.read()


def _login(chromium, base: str, username: str):
    context = chromium.new_context(viewport={"width": 1280, "height": 900}, base_url=base)
    context.set_default_timeout(60_000)
    page = context.new_page()
    page.goto("/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{base}/")
    return context, page


def _cookie(context) -> str:
    return "; ".join(f"{c['name']}={c['value']}" for c in context.cookies())


def lab_cell(chromium, base: str, lab: str, code: str, name: str, diagnose) -> str:
    """As alice, open JupyterLab at ``lab`` through the portal, start a Python notebook, run one cell and
    return its output. Keeps a screenshot (test-artifacts/e2e/<name>.png); on failure prints where it
    stopped and ``diagnose()`` (the app's log)."""
    context, page = _login(chromium, base, "alice")
    try:
        page.goto(lab + "lab")
        page.locator(".jp-LauncherCard[title^='Python 3']").first.click()
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for()  # the kernel is up, over the proxied WebSocket
        page.locator(".jp-NotebookPanel .jp-Cell .cm-content").first.click()
        page.keyboard.insert_text(code)
        page.keyboard.press("Shift+Enter")
        output = page.locator(".jp-OutputArea-output").first
        output.wait_for()
        shot(page, name)
        return output.inner_text().strip()
    except Exception:
        print("failed at", shot(page, name + "-failed"))
        print(diagnose())
        raise
    finally:
        context.close()


def test_jupyterlab_through_the_portal_runs_a_cell_with_the_jobs_gpu_environment(job, chromium, portal_asgi, node):
    from pathlib import Path

    printed = lab_cell(chromium, portal_asgi, LAB, 'import os; print("GPUS=" + os.environ["CUDA_VISIBLE_DEVICES"] + '
                       '" JOB=" + os.environ["GPUPORTAL_JOB_ID"])', "session-jupyterlab",
                       lambda: "".join(p.read_text()[-6000:] for p in Path(node.driver.state_dir).glob("*/log")))
    assert printed == f"GPUS=0,1 JOB={JOB}"


def test_dashboard_card_connects_to_the_web_terminal_which_runs_a_command(job, chromium, portal_asgi):
    context, dashboard = _login(chromium, portal_asgi, "alice")
    try:
        cards = dashboard.get_by_role("region", name="Interactive sessions")
        terminal = cards.get_by_role("listitem").filter(has_text="Terminal · sh")
        assert "Running" in terminal.inner_text() and cards.get_by_role("listitem").count() == 3
        shot(dashboard, "session-cards")
        with context.expect_page() as opened:
            terminal.get_by_role("link", name="Connect").click()
        page = opened.value
        page.get_by_text("connected", exact=True).wait_for()
        page.locator(".xterm-helper-textarea").focus()
        page.keyboard.type('echo "gpus=$CUDA_VISIBLE_DEVICES job=$GPUPORTAL_JOB_ID"\n')
        page.locator(".xterm-rows", has_text=f"gpus=0,1 job={JOB}").wait_for()
        shot(page, "session-terminal")
    finally:
        context.close()


def test_another_tenant_gets_404_on_the_session_and_its_websocket(job, chromium, portal_asgi):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    ws_base = portal_asgi.replace("http://", "ws://")
    context, _ = _login(chromium, portal_asgi, "charlie")
    try:
        charlie = _cookie(context)
        assert requests.get(portal_asgi + LAB + "lab", headers={"Cookie": charlie}).status_code == 404
        assert requests.get(portal_asgi + LAB + "api/contents", headers={"Cookie": charlie}).status_code == 404
        for path in (SHELL + "ws", LAB + "api/events/subscribe"):
            with pytest.raises(InvalidStatus) as refused:
                connect(ws_base + path, additional_headers={"Cookie": charlie}, open_timeout=10)
            assert refused.value.response.status_code == 404
    finally:
        context.close()
    # Nobody logged in, a forged cookie, and a session this job does not publish: 404 as well.
    assert requests.get(portal_asgi + LAB + "lab").status_code == 404
    assert requests.get(portal_asgi + LAB + "lab", headers={"Cookie": "sessionid=forged"}).status_code == 404
    context, _ = _login(chromium, portal_asgi, "alice")
    try:
        alice = _cookie(context)
        assert requests.get(portal_asgi + f"/sessions/{JOB}/other/", headers={"Cookie": alice}).status_code == 404
        # The owner's WebSocket goes through, and a shell answers on it.
        with connect(ws_base + SHELL + "ws", additional_headers={"Cookie": alice}, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "input", "data": "echo owner-$((6*7))\n"}))
            seen = b""
            deadline = time.monotonic() + 20
            while b"owner-42" not in seen and time.monotonic() < deadline:
                seen += ws.recv(timeout=10)
            assert b"owner-42" in seen
        # A WebSocket opened from another site is refused even with the owner's cookie.
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_base + SHELL + "ws", additional_headers={"Cookie": alice, "Origin": "http://evil.example"},
                    open_timeout=10)
        assert refused.value.response.status_code == 403
    finally:
        context.close()


def test_the_node_and_the_app_refuse_a_connection_without_the_secret(node, portal_asgi, job):
    # The gateway: unknown without the secret, served with it.
    assert requests.get(node.gateway.url + LAB + "api/status").status_code == 404
    assert requests.get(node.gateway.url + LAB + "api/status",
                        headers={"X-Gpuportal-Session-Secret": "wrong"}).status_code == 404
    assert requests.get(node.gateway.url + LAB + "api/status",
                        headers={"X-Gpuportal-Session-Secret": SECRET}).status_code == 200
    # JupyterLab itself, on its socket: the secret is its token.
    assert _unix_get(node.socket, LAB + "api/contents")[0] == 403
    assert _unix_get(node.socket, LAB + "api/contents", token="wrong")[0] == 403
    assert _unix_get(node.socket, LAB + "api/contents", token=SECRET)[0] == 200


def test_an_http_app_gpuctl_shell_and_gpuctl_port_forward(job, portal_asgi):
    from portal.cli.sessions import port_forward

    token = job.alice_token
    bearer = {"Authorization": f"Bearer {token}"}
    # The HTTP app is served at its own root behind the session's path.
    r = requests.get(portal_asgi + WEB + "hello.txt", headers=bearer)
    assert r.status_code == 200 and r.text == "hello from the job\n"
    assert requests.get(portal_asgi + WEB + "hello.txt").status_code == 404
    # gpuctl shell: a non-interactive shell in the job, through the portal.
    env = {**os.environ, "GPUCTL_URL": portal_asgi, "GPUCTL_TOKEN": token, "GPUCTL_CONFIG": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "portal.cli", "shell", str(JOB)], env=env, timeout=60,
                          input=b"echo shell-$((6*7)) $CUDA_VISIBLE_DEVICES\nexit\n", capture_output=True)
    assert b"shell-42 0,1" in done.stdout, done
    # gpuctl port-forward: a local port carried to the job's published port.
    stop, bound = threading.Event(), []
    session = requests.get(portal_asgi.replace("localhost", "127.0.0.1") + "/api/v1/sessions/", headers=bearer,
                           params={"job": JOB}).json()["results"]
    web = next(s for s in session if s["name"] == "web")
    thread = threading.Thread(target=port_forward, args=(portal_asgi, token, web, 0),
                              kwargs={"ready": bound.append, "stop": stop}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: bound, 10, "port-forward to listen")
        r = requests.get(f"http://127.0.0.1:{bound[0]}/hello.txt", timeout=20)
        assert r.status_code == 200 and r.text == "hello from the job\n"
    finally:
        stop.set()
        thread.join(10)
    done = subprocess.run([sys.executable, "-m", "portal.cli", "port-forward", str(JOB), "9:9999"], env=env,
                          timeout=60, capture_output=True, text=True)
    assert done.returncode == 1 and "publishes no port 9999" in done.stderr, done


def test_oversized_frames_and_too_many_connections_are_refused(job, portal_asgi, settings):
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    url = portal_asgi.replace("http://", "ws://") + SHELL + "ws"
    bearer = {"Authorization": f"Bearer {job.alice_token}"}
    # A message over the server's bound (1 MiB here, SESSION_MAX_FRAME_BYTES in production) closes the socket: 1009.
    settings.SESSION_MAX_FRAME_BYTES = 1 << 20
    with connect(url, additional_headers=bearer, open_timeout=10, max_size=None) as ws:
        ws.send(json.dumps({"type": "input", "data": "x" * (2 << 20)}))
        deadline = time.monotonic() + 20
        with pytest.raises(ConnectionClosed) as closed:
            while time.monotonic() < deadline:  # the shell's prompt may come first
                ws.recv(timeout=20)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    # One user's open connections are bounded: past the limit, 429 until one closes.
    settings.SESSION_MAX_CONNECTIONS_PER_USER = 2
    with connect(url, additional_headers=bearer, open_timeout=10), \
            connect(url, additional_headers=bearer, open_timeout=10):
        with pytest.raises(InvalidStatus) as refused:
            connect(url, additional_headers=bearer, open_timeout=10)
        assert refused.value.response.status_code == 429
    wait_for(lambda: _opens(url, bearer), 10, "a connection to be allowed again once the others closed")


def _opens(url, headers) -> bool:
    from websockets.sync.client import connect

    try:
        with connect(url, additional_headers=headers, open_timeout=10):
            return True
    except Exception:
        return False


def test_a_person_the_owner_names_gets_in_until_they_leave_the_organization(job, demo, portal_asgi):
    from django.contrib.auth import get_user_model
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from portal.core.context import Actor
    from portal.interactive.models import Session
    from portal.interactive.services import session_share
    from portal.tenancy.models import Membership, Project

    erin = get_user_model().objects.create_user("erin", password="x-erin-pass-123")
    audio = Project.objects.create(organization=demo.vision.organization, slug="audio", name="Audio")
    Membership.objects.create(project=audio, user=erin, role="member")
    bearer = {"Authorization": f"Bearer {make_token(erin)}"}
    ws = portal_asgi.replace("http://", "ws://") + SHELL + "ws"

    def refused() -> bool:
        with pytest.raises(InvalidStatus) as no:
            connect(ws, additional_headers=bearer, open_timeout=10)
        return (requests.get(portal_asgi + LAB + "api/status", headers=bearer).status_code == 404
                and no.value.response.status_code == 404)

    assert refused()
    for name in ("lab", "sh"):
        session_share(actor=Actor(user=demo.users["alice"]), session=Session.objects.get(job=job, name=name),
                      users=["erin"])
    assert requests.get(portal_asgi + LAB + "api/status", headers=bearer).status_code == 200
    with connect(ws, additional_headers=bearer, open_timeout=10) as shell:
        shell.send(json.dumps({"type": "input", "data": "echo erin-$((6*7))\n"}))
        seen, deadline = b"", time.monotonic() + 20
        while b"erin-42" not in seen and time.monotonic() < deadline:
            seen += shell.recv(timeout=10)
        assert b"erin-42" in seen
    Membership.objects.filter(user=erin).delete()  # checked on the next request and WebSocket
    assert refused()
