"""Interactive sessions (docs/sessions.md): what the portal's proxy costs.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/session_bench.py

On a throwaway PostgreSQL database (`gpuportal_bench_sessions`) it runs the real parts in one
process: the agent's session gateway (agents/sessions.py) with a process-sandbox job, and
portal.asgi under uvicorn (the proxy). It prints:

1. submit to JupyterLab usable: from the launch of a job running `python -m jupyterlab` to the
   first 200 of its /api/status through the portal (the scheduler and Celery are not in it);
2. the proxy's added latency: a small GET straight to the app, through the gateway, and through
   the portal (median and p95 of --requests);
3. a 100 MB download: straight from the app, and through gateway and portal (MB/s);
4. memory of --websockets idle WebSockets held open through the portal (RSS growth of this
   process, which holds the proxy and the gateway and the clients' side).

With --sandbox docker the job runs in the docker sandbox (network none) from the JupyterLab image the
tests build (tests/interactive/jupyter_image.py), its HTTP app on the container's loopback, reached
through the gateway's relay into the container's network namespace; the host has no direct way to
it, so there is no "direct" figure. --relay exec carries the HTTP app's connections as an agent not
run as root does (agents/sandbox/docker_sessions.py: a docker exec of a forwarder per connection).
"""
import argparse
import asyncio
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchdb import PRODUCTION, django_setup, throwaway_database

django_setup(PRODUCTION)

DB_NAME = "gpuportal_bench_sessions"
JOB = 424242
BASE_SECRET = "bench-secret-" + "x" * 30  # the session's own; the node gets attempt 1's key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def timed_gets(url, n, headers):
    import requests

    s = requests.Session()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = s.get(url, headers=headers)
        assert r.status_code == 200, (url, r.status_code)
        out.append((time.perf_counter() - t) * 1000)
    return out


def download(url, headers) -> float:
    import requests

    t = time.perf_counter()
    n = 0
    with requests.get(url, headers=headers, stream=True) as r:
        assert r.status_code == 200, r.status_code
        for chunk in r.iter_content(1 << 20):
            n += len(chunk)
    return n / (1 << 20) / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--websockets", type=int, default=200)
    ap.add_argument("--sandbox", choices=["process", "docker"], default="process")
    ap.add_argument("--relay", choices=["netns", "exec"], default="netns",
                    help="docker: the HTTP app's way in (exec: as an agent not run as root)")
    args = ap.parse_args()

    import uvicorn
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client

    from agents.sandbox import LaunchSpec
    from agents.sandbox.process_driver import ProcessDriver
    from agents.sessions import Gateway, SessionDriver
    from portal.interactive.models import Session
    from portal.interactive.services import session_report, sessions_create
    from portal.jobs.models import Job, JobState
    from portal.tenancy.models import Project

    with throwaway_database(DB_NAME), tempfile.TemporaryDirectory() as tmp:
        call_command("seed_demo", stdout=open(os.devnull, "w"))
        alice = get_user_model().objects.get(username="alice")
        client = Client()
        client.force_login(alice)
        cookie = {"Cookie": f"sessionid={client.cookies['sessionid'].value}"}
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "small.txt").write_text("ok\n")
        with open(site / "big.bin", "wb") as f:
            f.truncate(100 * 1024 * 1024)
        gateway = Gateway(listen="127.0.0.1:0").start()
        docker = args.sandbox == "docker"
        if docker:  # the app serves the same files from the container's /work, on its own loopback
            import docker as docker_sdk

            from agents.sandbox.docker_driver import DockerDriver
            from tests.interactive import jupyter_image

            engine = docker_sdk.from_env()
            image, web_port, web = jupyter_image.ensure(engine), 8000, None
            command = ["sh", "-c", "mkdir /work/site && cd /work/site && echo ok > small.txt && "
                       "head -c 104857600 /dev/zero > big.bin && "
                       f"(python3 -m http.server {web_port} --bind 127.0.0.1 >/dev/null 2>&1 &) && "
                       "cd /work && exec python3 -m jupyterlab"]
            driver = SessionDriver(DockerDriver(node="bench-sessions", client=engine, simulated_gpus=True,
                                                state_dir=tmp), gateway)
        else:
            web_port, image, command = free_port(), "local", [sys.executable, "-m", "jupyterlab"]
            web = subprocess.Popen([sys.executable, "-m", "http.server", str(web_port), "--bind", "127.0.0.1"],
                                   cwd=site, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            driver = SessionDriver(ProcessDriver(node="bench", state_dir=tmp), gateway)
        driver.lease_s = 3600.0
        lab, web_path = f"/sessions/{JOB}/lab/", f"/sessions/{JOB}/web/"
        job = Job.objects.create(pk=JOB, project=Project.objects.get(slug="vision"), user=alice, name="bench",
                                 image="local", command=["jupyter", "lab"], time_limit_s=3600,
                                 state=JobState.RUNNING)
        sessions_create(job, [{"name": "lab", "kind": "jupyter"}, {"name": "web", "kind": "http", "port": web_port}])
        Session.objects.filter(job=job).update(secret=BASE_SECRET)
        from portal.interactive.models import attempt_secret

        key = attempt_secret(BASE_SECRET, 1)
        for name in ("lab", "web"):
            session_report(node=None, job=job, attempt=1, name=name, state="running", gateway_url=gateway.url)

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        portal = f"http://127.0.0.1:{sock.getsockname()[1]}"
        from portal.asgi import application

        server = uvicorn.Server(uvicorn.Config(application, log_level="warning", lifespan="on"))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        import requests

        handle = None
        try:
            # 1. Launch to usable.
            t0 = time.perf_counter()
            handle = driver.launch(LaunchSpec(
                job_id=str(JOB), attempt=1, image=image, command=command, memory_mb=2048, cpus=2.0,
                sessions=[{"name": "lab", "kind": "jupyter", "port": None, "secret": key, "base_url": lab},
                          {"name": "web", "kind": "http", "port": web_port, "secret": key, "base_url": web_path}]))
            while True:
                try:
                    if requests.get(portal + lab + "api/status", headers=cookie, timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.1)
            print(f"launch to JupyterLab usable through the portal: {time.perf_counter() - t0:.1f} s")
            if docker and args.relay == "exec":  # the app's way in as a non-root agent's gateway has it
                from agents.sandbox.docker_sessions import ExecRelay

                pub = gateway._published[str(JOB)]
                gateway.publish(str(JOB), 1, list(pub.sessions.values()),
                                {**pub.targets, "web": ("relay", ExecRelay(engine, handle.ref, web_port))})

            # 2. Latency of a small GET.
            secret = {"X-Gpuportal-Session-Secret": key}
            while requests.head(gateway.url + web_path + "big.bin", headers=secret).status_code != 200:
                time.sleep(0.1)  # the docker job's app starts after its 100 MB file is written
            direct = [] if docker else [("direct", timed_gets(f"http://127.0.0.1:{web_port}/small.txt",
                                                              args.requests, {}))]
            via_gw = timed_gets(gateway.url + web_path + "small.txt", args.requests, secret)
            via_portal = timed_gets(portal + web_path + "small.txt", args.requests, cookie)
            for label, values in (*direct, ("gateway", via_gw), ("portal+gateway", via_portal)):
                print(f"small GET {label:>15}: median {statistics.median(values):6.2f} ms  "
                      f"p95 {pct(values, 0.95):6.2f} ms  ({args.requests} requests)")

            # 3. 100 MB download.
            direct = [] if docker else [("direct", f"http://127.0.0.1:{web_port}/big.bin", {})]
            for label, url, headers in (*direct, ("gateway", gateway.url + web_path + "big.bin", secret),
                                        ("portal+gateway", portal + web_path + "big.bin", cookie)):
                print(f"100 MB download {label:>15}: {download(url, headers):7.1f} MB/s")

            # 4. Idle WebSockets through the portal (the job's Jupyter event stream).
            from django.conf import settings

            settings.SESSION_MAX_CONNECTIONS_PER_USER = args.websockets + 10
            before = rss_mb()

            async def hold():
                import websockets

                url = portal.replace("http://", "ws://") + lab + "api/events/subscribe"
                conns = [await websockets.connect(url, additional_headers=cookie, compression=None)
                         for _ in range(args.websockets)]
                await asyncio.sleep(2)
                grown = rss_mb() - before
                for c in conns:
                    await c.close()
                return grown

            grown = asyncio.run(hold())
            print(f"{args.websockets} idle WebSockets through the portal: +{grown:.1f} MB RSS "
                  f"({grown * 1024 / args.websockets:.0f} KB each: proxy, gateway and client sides in one process)")
        finally:
            if handle is not None:
                driver.remove(handle)
            server.should_exit = True
            gateway.stop()
            if web is not None:
                web.terminate()
                web.wait(10)


if __name__ == "__main__":
    main()
