"""The deployment kit end to end on loopback: Debian's nginx with deploy/nginx/gpuportal.conf (TLS,
static files) in front of gunicorn with deploy/gunicorn.conf.py (production settings, DEBUG=0), a
Celery worker, and an agent that reaches the portal through nginx over TLS. A job submitted
through nginx runs to `succeeded`.
"""
import os
import secrets
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests
from django.conf import settings
from django.db import connection

from portal.core.context import Actor
from portal.nodes.services import node_add
from tests.conftest import make_token
from tests.procs import start_process, stop_process, wait_for

REPO = Path(__file__).resolve().parents[2]
NGINX = "/usr/sbin/nginx"
pytestmark = pytest.mark.django_db(transaction=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_site(tmp: Path, *, http_port: int, https_port: int, socket_path: Path, static: Path, cert: Path,
                key: Path) -> str:
    """deploy/nginx/gpuportal.conf with this machine's ports, socket, static folder and certificate.
    Every replacement must apply: a change of the kit's shape fails here, not silently."""
    site = (REPO / "deploy/nginx/gpuportal.conf").read_text()
    for old, new in [
        ("listen 80;", f"listen 127.0.0.1:{http_port};"),
        ("listen [::]:80;", ""),
        ("listen 443 ssl http2;", f"listen 127.0.0.1:{https_port} ssl http2;"),
        ("listen [::]:443 ssl http2;", ""),
        ("/etc/letsencrypt/live/portal.example.com/fullchain.pem", str(cert)),
        ("/etc/letsencrypt/live/portal.example.com/privkey.pem", str(key)),
        ("server_name portal.example.com;", "server_name 127.0.0.1 localhost;"),
        ("unix:/run/gpuportal/gunicorn.sock", f"unix:{socket_path}"),
        ("/var/lib/gpuportal/static/", f"{static}/"),
    ]:
        assert old in site, f"deploy/nginx/gpuportal.conf no longer has {old!r}"
        site = site.replace(old, new)
    return site


@pytest.fixture
def deployed(tmp_path, demo):
    """gunicorn + nginx + a Celery worker + an agent; every process stopped whatever happens."""
    assert connection.vendor == "postgresql", "this test needs PostgreSQL (DATABASE_URL)"
    assert settings.CELERY_BROKER_URL.startswith("redis"), "this test needs Redis (CELERY_BROKER_URL)"
    if not os.path.exists(NGINX):
        pytest.fail("nginx is missing: .ci/services.sh installs it (apt-get install nginx)", pytrace=False)
    db = settings.DATABASES["default"]
    env = {**os.environ, "DEBUG": "0", "SECRET_KEY": secrets.token_urlsafe(64), "ALLOWED_HOSTS": "127.0.0.1,localhost",
           "USE_X_FORWARDED_PROTO": "1", "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
           "CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "GPUPORTAL_VAR_DIR": str(tmp_path / "var"),
           "STATIC_ROOT": str(tmp_path / "static"), "GUNICORN_BIND": f"unix:{tmp_path / 'gunicorn.sock'}",
           "GUNICORN_WORKERS": "2", "NODE_HEARTBEAT_INTERVAL_S": "1"}
    # The production steps of docs/deploy.md that this needs: collectstatic, then the processes.
    subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"], cwd=REPO, env=env,
                   check=True, timeout=300)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    http_port, https_port = free_port(), free_port()
    (tmp_path / "nginx").mkdir()
    (tmp_path / "nginx/site.conf").write_text(render_site(
        tmp_path, http_port=http_port, https_port=https_port, socket_path=tmp_path / "gunicorn.sock",
        static=tmp_path / "static", cert=cert, key=key))
    # Workers as this test's user: in production nginx's www-data is in group gpuportal (docs/deploy.md),
    # here the socket and the static files sit in this user's private temporary folder.
    import pwd

    user = pwd.getpwuid(os.getuid()).pw_name
    (tmp_path / "nginx/nginx.conf").write_text(f"""
daemon off;
{"user " + user + ";" if os.getuid() == 0 else ""}
worker_processes 1;
pid {tmp_path}/nginx/nginx.pid;
events {{ worker_connections 256; }}
http {{
    include /etc/nginx/mime.types;
    access_log {tmp_path}/nginx/access.log;
    client_body_temp_path {tmp_path}/nginx/body;
    proxy_temp_path {tmp_path}/nginx/proxy;
    fastcgi_temp_path {tmp_path}/nginx/fastcgi;
    uwsgi_temp_path {tmp_path}/nginx/uwsgi;
    scgi_temp_path {tmp_path}/nginx/scgi;
    include {tmp_path}/nginx/site.conf;
}}
""")
    name = f"dep-{uuid.uuid4().hex[:8]}"
    _, node_token = node_add(actor=Actor(user=demo.users["admin"]), name=name)
    base = f"https://127.0.0.1:{https_port}"
    logs, procs = {}, {}

    def start(key, argv, **extra):
        logs[key] = open(tmp_path / f"{key}.log", "w+")
        procs[key] = start_process(argv, cwd=REPO, env={**env, **extra}, stdout=logs[key], stderr=subprocess.STDOUT)

    def log(key) -> str:
        logs[key].flush()
        return (tmp_path / f"{key}.log").read_text()

    try:
        start("gunicorn", [str(Path(sys.executable).parent / "gunicorn"), "-c", str(REPO / "deploy/gunicorn.conf.py"),
                           "portal.wsgi:application"])
        start("nginx", [NGINX, "-p", str(tmp_path / "nginx"), "-c", str(tmp_path / "nginx/nginx.conf"),
                        "-e", str(tmp_path / "nginx/error.log")])
        start("worker", [sys.executable, "-m", "celery", "-A", "portal", "--quiet", "worker", "-Q", "scheduler,default",
                         "-P", "solo", "-n", f"sched-{name}@%h", "--loglevel", "INFO"])

        last = []

        def answers():
            try:
                r = requests.get(f"{base}/login/", verify=str(cert), timeout=2)
                last[:] = [f"HTTP {r.status_code}: {r.text[:300]}"]
                return r.status_code == 200
            except requests.RequestException as exc:
                last[:] = [repr(exc)]
                return False
        up = wait_for(lambda: answers() or any(p.poll() is not None for p in procs.values()) or None, 60,
                      "the portal to answer through nginx", fail=False)
        error_log = tmp_path / "nginx/error.log"
        assert up and all(p.poll() is None for p in procs.values()), (
            f"last answer: {last}\n" + "\n".join(f"{k} ({'running' if p.poll() is None else 'exited'}):\n"
                                                 f"{log(k)[-2000:]}" for k, p in procs.items())
            + f"\nnginx error log:\n{error_log.read_text()[-2000:] if error_log.exists() else ''}")
        # The agent reaches the portal through nginx, trusting the site's certificate.
        start("agent", [sys.executable, "-m", "agents", "--portal", base, "--token", node_token, "--broker",
                        settings.CELERY_BROKER_URL, "--name", name, "--gpus", "sim:2xH100-80GB", "--sandbox", "docker",
                        "--stop-grace", "1"], REQUESTS_CA_BUNDLE=str(cert))
        wait_for(lambda: " ready." in log("agent") or procs["agent"].poll() is not None, 60, "the agent")
        assert procs["agent"].poll() is None, log("agent")[-3000:]
        yield type("Deployed", (), dict(base=base, http=f"http://127.0.0.1:{http_port}", cert=str(cert), node=name,
                                        token=make_token(demo.users["alice"], ["read", "submit"]), log=log,
                                        node_token=node_token, stop_web=lambda: stop_process(procs["gunicorn"])))
    finally:
        for key in ("agent", "worker", "nginx", "gunicorn"):
            if key in procs:
                stop_process(procs[key])
        for f in logs.values():
            f.close()
        import docker

        client = docker.from_env()
        for c in client.containers.list(all=True, filters={"label": [f"gpuportal.node={name}"]}):
            c.remove(force=True)


def test_a_job_submitted_through_nginx_runs_to_succeeded(deployed):
    d = deployed
    api = requests.Session()
    api.trust_env = False  # a CA bundle from the environment would override verify=
    api.verify = d.cert
    api.headers["Authorization"] = f"Bearer {d.token}"
    r = api.post(f"{d.base}/api/v1/jobs/", json={
        "project": "vision", "name": "behind-nginx", "image": "gpuportal/busybox:latest",
        "command": ["sh", "-c", "echo hello through nginx"], "resources": {"gpus": 1, "cpus": 0.5, "memory_mb": 64}},
        timeout=10)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = wait_for(lambda: (j := api.get(f"{d.base}/api/v1/jobs/{job_id}/", timeout=10).json())["state"]
                   in ("succeeded", "failed", "cancelled") and j, 120,
                   f"job {job_id} to end; agent log:\n{d.log('agent')[-3000:]}\ngunicorn:\n{d.log('gunicorn')[-2000:]}")
    assert job["state"] == "succeeded" and job["exit_code"] == 0 and job["node"] == d.node, job
    logs = wait_for(lambda: (x := api.get(f"{d.base}/api/v1/jobs/{job_id}/logs/", timeout=10).json())["complete"]
                    and x, 30, "the complete log")
    assert logs["data"].endswith("hello through nginx\n")


def test_nginx_serves_static_files_and_redirects_to_https(deployed):
    d = deployed
    static = requests.get(f"{d.base}/static/vendor/htmx/htmx.min.js", verify=d.cert, timeout=10)
    assert static.status_code == 200 and "immutable" in static.headers["Cache-Control"]
    assert "gunicorn" not in static.headers.get("Server", "").lower()
    plain = requests.get(f"{d.http}/jobs/", allow_redirects=False, timeout=10)
    assert plain.status_code == 301 and plain.headers["Location"].startswith("https://127.0.0.1")
    # Django sees https through the proxy header: no redirect loop, secure cookies, HSTS.
    login = requests.get(f"{d.base}/login/", verify=d.cert, timeout=10)
    assert login.status_code == 200 and "max-age" in login.headers["Strict-Transport-Security"]
    assert "secure" in login.headers.get("Set-Cookie", "secure").lower()


def test_with_gunicorn_stopped_nginx_answers_the_portals_outage_and_the_agent_holds_its_lease(deployed):
    """Every portal process restarted: nginx cannot connect to gunicorn and says so as the portal's own
    outage (503, Retry-After, X-Gpuportal-Outage: web), which the agent takes as renewing its lease."""
    d = deployed
    d.stop_web()
    r = requests.post(f"{d.base}/api/agent/v1/heartbeat", json={"samples": [], "jobs": []}, verify=d.cert, timeout=10,
                      headers={"Authorization": f"Bearer {d.node_token}"})
    assert r.status_code == 503 and r.headers["X-Gpuportal-Outage"] == "web" and r.headers["Retry-After"] == "5"
    assert "restarting" in r.json()["detail"]
    wait_for(lambda: "the portal's web is out; jobs keep running" in d.log("agent"), 15,
             "the agent to take the answer as the portal's outage")
