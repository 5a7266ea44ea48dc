"""Interactive sessions in the docker sandbox (docs/sessions.md): JupyterLab in a container that keeps
--network none, reached by the agent's gateway through the unix socket in the job's session folder
(bind-mounted into the container), proxied by the portal; a terminal by ``docker exec`` with a TTY.

The JupyterLab image is built on this machine from this venv (tests/interactive/jupyter_image.py),
once per change of its inputs."""
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import requests

from portal.interactive.models import attempt_secret
from tests.conftest import make_token
from tests.procs import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

JOB = 987002  # fixed: JupyterLab's base URL (/sessions/<job>/lab/) is set when it starts
BASE_SECRET = "docker-session-secret-0123456789abcdef"  # the session's own; the node knows attempt 1's key
SECRET = attempt_secret(BASE_SECRET, 1)
LAB = f"/sessions/{JOB}/lab/"
SHELL = f"/sessions/{JOB}/sh/"
WEB = f"/sessions/{JOB}/web/"
WEB_PORT = 8917  # on the container's own loopback; nothing listens on it on the host
PROJECT_ID = 5  # the node runs the job as this project's uid


@pytest.fixture(scope="module")
def docker_node(tmp_path_factory):
    """A docker sandbox running JupyterLab from the locally built image, published on a gateway."""
    import docker

    from agents.sandbox import LaunchSpec
    from agents.sandbox.docker_driver import DockerDriver
    from agents.sessions import Gateway, SessionDriver
    from tests.interactive import jupyter_image

    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:
        pytest.fail(f"the Docker engine is not running ({exc}); start it with .ci/docker.sh", pytrace=False)
    image = jupyter_image.ensure(client)
    node = f"e2e-dsessions-{uuid.uuid4().hex[:6]}"
    state_dir = str(tmp_path_factory.mktemp("agent"))
    gateway = Gateway(listen="127.0.0.1:0").start()
    inner = DockerDriver(node=node, client=client, simulated_gpus=True, state_dir=state_dir)
    driver = SessionDriver(inner, gateway)
    # JupyterLab, and a plain HTTP server on the container's loopback (kind http).
    command = ["sh", "-c", "echo hello from the container > /work/hello.txt && "
               f"(python3 -m http.server {WEB_PORT} --bind 127.0.0.1 --directory /work >/dev/null 2>&1 &) && "
               "exec python3 -m jupyterlab"]
    spec = LaunchSpec(job_id=str(JOB), attempt=1, image=image, command=command,
                      gpu_indexes=[0, 1], gpu_uuids=["GPU-sim-0", "GPU-sim-1"], memory_mb=1024, cpus=1.0,
                      project_id=PROJECT_ID, sessions=[
                          {"name": "lab", "kind": "jupyter", "port": None, "secret": SECRET, "base_url": LAB},
                          {"name": "sh", "kind": "terminal", "port": None, "secret": SECRET, "base_url": SHELL},
                          {"name": "web", "kind": "http", "port": WEB_PORT, "secret": SECRET, "base_url": WEB}])
    handle = driver.launch(spec)
    try:
        target = driver.session_targets(handle, spec.sessions)["lab"]
        url = gateway.url + LAB + "api/status"
        if not wait_for(lambda: _status(url) == 200, 120, "JupyterLab to answer in its container", fail=False):
            logs = client.containers.get(handle.ref).logs().decode(errors="replace")
            pytest.fail(f"JupyterLab did not answer on {target[1]}; its log:\n{logs[-4000:]}")
        yield type("Node", (), {"gateway": gateway, "driver": driver, "handle": handle, "client": client,
                                "socket": target[1], "uid": inner.job_uid(spec), "name": node,
                                "state_dir": state_dir})
    finally:
        driver.remove(handle)
        gateway.stop()
        for c in client.containers.list(all=True, filters={"label": [f"gpuportal.node={node}"]}):
            c.remove(force=True)


def _status(url: str) -> int:
    try:
        return requests.get(url, headers={"X-Gpuportal-Session-Secret": SECRET}, timeout=5).status_code
    except requests.RequestException:
        return 0


@pytest.fixture
def job(demo, docker_node, settings):
    """alice's running docker job with its two sessions, reported running by the node."""
    from portal.interactive.models import Session
    from portal.interactive.services import session_report, sessions_create
    from portal.jobs.models import Job, JobState

    settings.ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
    alice = demo.users["alice"]
    j = Job.objects.create(pk=JOB, project=demo.vision, user=alice, name="lab", image="gpuportal/jupyter",
                           command=["python3", "-m", "jupyterlab"], time_limit_s=3600, state=JobState.RUNNING,
                           gpus=2, sandbox="docker")
    sessions_create(j, [{"name": "lab", "kind": "jupyter"}, {"name": "sh", "kind": "terminal"},
                        {"name": "web", "kind": "http", "port": WEB_PORT}])
    Session.objects.filter(job=j).update(secret=BASE_SECRET)
    for name in ("lab", "sh", "web"):
        session_report(node=None, job=j, attempt=1, name=name, state="running", gateway_url=docker_node.gateway.url)
    j.alice = {"Authorization": f"Bearer {make_token(alice)}"}
    j.charlie = {"Authorization": f"Bearer {make_token(demo.users['charlie'])}"}
    return j


def test_jupyterlab_in_a_docker_job_answers_its_owner_through_the_portal_and_runs_code(job, portal_asgi, docker_node):
    from websockets.sync.client import connect

    r = requests.get(portal_asgi + LAB + "api/status", headers=job.alice, timeout=30)
    assert r.status_code == 200 and "started" in r.json()
    # A kernel in the container runs a cell and prints the job's GPU environment and its user.
    kernel = requests.post(portal_asgi + LAB + "api/kernels", headers=job.alice, json={"name": "python3"},
                           timeout=60)
    assert kernel.status_code == 201, kernel.text
    ws_url = portal_asgi.replace("http://", "ws://") + LAB + f"api/kernels/{kernel.json()['id']}/channels"
    code = 'import os; print("GPUS=" + os.environ["CUDA_VISIBLE_DEVICES"], "UID=%d" % os.getuid())'
    msg_id = uuid.uuid4().hex
    with connect(ws_url, additional_headers=job.alice, open_timeout=30, max_size=None) as ws:
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "t", "session": msg_id,
                       "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        printed, deadline = "", time.monotonic() + 60
        while "UID=" not in printed and time.monotonic() < deadline:
            m = json.loads(ws.recv(timeout=60))
            if m.get("msg_type") == "stream" and m["parent_header"].get("msg_id") == msg_id:
                printed += m["content"]["text"]
    assert printed.strip() == f"GPUS=0,1 UID={docker_node.uid}"


def test_chromium_opens_the_docker_jobs_jupyterlab_through_the_portal_and_runs_a_cell(job, chromium, portal_asgi,
                                                                                      docker_node):
    from tests.e2e.test_sessions_e2e import lab_cell

    container = docker_node.client.containers.get(docker_node.handle.ref)
    printed = lab_cell(chromium, portal_asgi, LAB, 'import os; print("GPUS=" + os.environ["CUDA_VISIBLE_DEVICES"], '
                       '"UID=%d" % os.getuid(), "NET=" + ",".join(sorted(os.listdir("/sys/class/net"))))',
                       "session-jupyterlab-docker", lambda: container.logs().decode(errors="replace")[-6000:])
    # The job's GPUs, its project's uid, and a network namespace with nothing but loopback.
    assert printed == f"GPUS=0,1 UID={docker_node.uid} NET=lo"


def test_another_tenant_gets_404_on_a_docker_session_and_its_websocket(job, portal_asgi):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    assert requests.get(portal_asgi + LAB + "api/status", headers=job.charlie, timeout=30).status_code == 404
    assert requests.get(portal_asgi + LAB + "api/contents", headers=job.charlie, timeout=30).status_code == 404
    with pytest.raises(InvalidStatus) as refused:
        connect(portal_asgi.replace("http://", "ws://") + SHELL + "ws", additional_headers=job.charlie,
                open_timeout=10)
    assert refused.value.response.status_code == 404


def test_the_terminal_and_gpuctl_shell_run_commands_in_the_container(job, portal_asgi, docker_node):
    from websockets.sync.client import connect

    with connect(portal_asgi.replace("http://", "ws://") + SHELL + "ws", additional_headers=job.alice,
                 open_timeout=30) as ws:
        ws.send(json.dumps({"type": "resize", "cols": 120, "rows": 40}))
        ws.send(json.dumps({"type": "input", "data": "echo in-$((6*7)) uid=$(id -u) $(ls /run/gpuportal)\n"}))
        seen, deadline = b"", time.monotonic() + 30
        while b"in-42" not in seen and time.monotonic() < deadline:
            seen += ws.recv(timeout=30)
        # Read the rest of that line: the job's uid, and its session folder with JupyterLab's socket.
        while b"\n" not in seen[seen.index(b"in-42"):] and time.monotonic() < deadline:
            seen += ws.recv(timeout=30)
    line = seen[seen.index(b"in-42"):].split(b"\n")[0].decode()
    assert line.split() == ["in-42", f"uid={docker_node.uid}", "jupyter", "lab.sock"], line
    env = {**os.environ, "GPUCTL_URL": portal_asgi, "GPUCTL_TOKEN": job.alice["Authorization"].split()[1],
           "GPUCTL_CONFIG": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "portal.cli", "shell", str(JOB)], env=env, timeout=60,
                          input=b"echo shell-$((6*7)) $CUDA_VISIBLE_DEVICES $(cat /proc/1/comm)\nexit\n",
                          capture_output=True)
    assert b"shell-42 0,1 docker-init" in done.stdout, done
    # Each terminal's shell ends with its connection: no exec is left running in the container.
    container = docker_node.client.containers.get(docker_node.handle.ref)
    wait_for(lambda: not _running_execs(docker_node.client, container), 20, "the terminals' shells to end")


def _shell_says(gateway_url: str, key: dict, command: str, marker: bytes) -> bytes:
    """What a terminal straight from the gateway prints for ``command`` until ``marker`` (or 30 s)."""
    from websockets.sync.client import connect

    with connect(gateway_url.replace("http://", "ws://") + SHELL + "ws", additional_headers=key,
                 open_timeout=30) as ws:
        ws.send(json.dumps({"type": "input", "data": command + "\n"}))
        seen, deadline = b"", time.monotonic() + 30
        while marker not in seen and time.monotonic() < deadline:
            seen += ws.recv(timeout=30)
    return seen


def _running_execs(client, container) -> list:
    container.reload()
    return [e for e in container.attrs.get("ExecIDs") or [] if client.api.exec_inspect(e).get("Running")]


def test_an_http_app_on_the_containers_loopback_is_served_to_its_owner_only(job, portal_asgi, docker_node):
    r = requests.get(portal_asgi + WEB + "hello.txt", headers=job.alice, timeout=30)
    assert r.status_code == 200 and r.text == "hello from the container\n"
    assert requests.get(portal_asgi + WEB + "hello.txt", headers=job.charlie, timeout=30).status_code == 404
    # The app's port is the container's own: the host has no way to it but the gateway's.
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{WEB_PORT}/hello.txt", timeout=5)


def test_the_node_refuses_a_connection_without_the_secret_and_the_container_has_no_network(job, docker_node):
    gw = docker_node.gateway.url
    assert requests.get(gw + LAB + "api/status", timeout=10).status_code == 404
    assert requests.get(gw + LAB + "api/status", headers={"X-Gpuportal-Session-Secret": "wrong"},
                        timeout=10).status_code == 404
    # JupyterLab itself, on its socket on the host: the secret is its token.
    from tests.e2e.test_sessions_e2e import _unix_get

    assert _unix_get(docker_node.socket, LAB + "api/contents")[0] == 403
    assert _unix_get(docker_node.socket, LAB + "api/contents", token=SECRET)[0] == 200
    attrs = docker_node.client.containers.get(docker_node.handle.ref).attrs
    assert attrs["HostConfig"]["NetworkMode"] == "none" and attrs["HostConfig"]["ReadonlyRootfs"] is True
    mounts = {m["Destination"]: m for m in attrs["Mounts"]}
    assert mounts["/run/gpuportal"]["Source"] == os.path.dirname(docker_node.socket)
    st = os.stat(os.path.dirname(docker_node.socket))
    assert (st.st_uid, st.st_mode & 0o777) == (docker_node.uid, 0o700)
    assert os.stat(os.path.dirname(os.path.dirname(docker_node.socket))).st_mode & 0o777 == 0o700


def test_a_restarted_agent_serves_the_containers_sessions_again(docker_node):
    """A new agent (its own driver and gateway) adopts the running container and publishes its sessions
    from the record the first one left in its folder, the HTTP app's way in included."""
    from agents.sandbox.docker_driver import DockerDriver
    from agents.sessions import Gateway, SessionDriver

    gateway = Gateway(listen="127.0.0.1:0").start()
    try:
        driver = SessionDriver(DockerDriver(node=docker_node.name, client=docker_node.client, simulated_gpus=True,
                                            state_dir=docker_node.state_dir), gateway)
        assert [h.ref for _, _, h in driver.list_own()] == [docker_node.handle.ref]
        key = {"X-Gpuportal-Session-Secret": SECRET}
        assert requests.get(gateway.url + LAB + "api/status", headers=key, timeout=30).status_code == 200
        r = requests.get(gateway.url + WEB + "hello.txt", headers=key, timeout=30)
        assert r.status_code == 200 and r.text == "hello from the container\n"
        assert b"again-42" in _shell_says(gateway.url, key, "echo again-$((6*7))", b"again-42")
        relays = [r.folder for pub in gateway._published.values() for r in pub.relays.values()]
        assert len(relays) == 1 and os.path.isdir(relays[0])
    finally:
        gateway.stop()
    assert not os.path.exists(relays[0])  # a stopped gateway leaves no relay behind (the container runs on)


# An agent that is only in the docker group: it publishes the running container's HTTP app and terminal
# on a gateway of its own, and prints the gateway's URL and its uid.
NON_ROOT_AGENT = """
import json, os, sys, time
import docker
from agents.sandbox import SandboxHandle
from agents.sandbox.docker_driver import DockerDriver
from agents.sessions import Gateway
arg = json.loads(sys.argv[1])
gateway = Gateway(listen="127.0.0.1:0").start()
driver = DockerDriver(node=arg["node"], client=docker.from_env(), simulated_gpus=True, state_dir=arg["state"])
handle = SandboxHandle(driver="docker", ref=arg["ref"], job_id=arg["job"], attempt=1, started_at=time.time())
targets = driver.session_targets(handle, arg["sessions"])
gateway.publish(arg["job"], 1, arg["sessions"], targets, driver.session_shell(handle))
print(json.dumps({"url": gateway.url, "uid": os.geteuid(), "targets": {k: v[0] for k, v in targets.items()}}),
      flush=True)
sys.stdin.read()
gateway.stop()
"""


def test_an_agent_not_run_as_root_serves_the_http_app_and_hangs_up_its_shells(docker_node, tmp_path):
    """No entering namespaces without root: the relay carries each connection with docker exec of a
    forwarder in the container (its network stays none), and a closed terminal's shell is hung up from
    inside the container; no exec is left running after either."""
    import grp

    state = tmp_path / "agent"
    state.mkdir()
    os.chown(state, 65534, 65534)
    sessions = [{"name": "sh", "kind": "terminal", "port": None, "secret": SECRET, "base_url": SHELL},
                {"name": "web", "kind": "http", "port": WEB_PORT, "secret": SECRET, "base_url": WEB}]
    arg = {"node": docker_node.name, "state": str(state), "ref": docker_node.handle.ref, "job": str(JOB),
           "sessions": sessions}
    docker_gid = grp.getgrnam("docker").gr_gid
    # Only CAP_DAC_READ_SEARCH is kept: a checkout (and its .venv) may sit in a folder only root may
    # enter (mktemp -d makes 0700 ones), which an installed agent's code never does. It gives no way
    # into a namespace (that takes CAP_SYS_ADMIN), so the relay is still the only way in.
    agent = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", f"--groups={docker_gid}",
         "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search",
         sys.executable, "-c", NON_ROOT_AGENT, json.dumps(arg)],
        cwd=os.getcwd(), env={**os.environ, "HOME": str(state)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        said = json.loads(agent.stdout.readline())
        assert said["uid"] == 65534 and said["targets"] == {"web": "relay"}
        key = {"X-Gpuportal-Session-Secret": SECRET}
        for _ in range(3):  # each request its own connection, its own forwarder
            r = requests.get(said["url"] + WEB + "hello.txt", headers=key, timeout=30)
            assert r.status_code == 200 and r.text == "hello from the container\n"
        big = requests.get(said["url"] + WEB + "", headers=key, timeout=30)
        assert big.status_code == 200 and "hello.txt" in big.text
        assert b"nonroot-42" in _shell_says(said["url"], key, "echo nonroot-$((6*7))", b"nonroot-42")
        container = docker_node.client.containers.get(docker_node.handle.ref)
        # 120 s: under the whole suite on 2 cores the engine took over 20 s, and once over 60 s, to reap
        # a hung-up exec. Should one stay, the failure names what it runs.
        if not wait_for(lambda: not _running_execs(docker_node.client, container), 120, "", fail=False):
            left = [docker_node.client.api.exec_inspect(e) for e in _running_execs(docker_node.client, container)]
            raise AssertionError(f"execs still running after 120 s: {[e.get('ProcessConfig') for e in left]}")
        attrs = container.attrs
        assert attrs["HostConfig"]["NetworkMode"] == "none"
    finally:
        agent.stdin.close()
        agent.wait(30)
