"""`make run`: the web server, a Celery worker, Celery beat and one local agent, in one terminal.

Quiet by default: no Celery banners, no line per scheduling pass or heartbeat (settings.LOGGING;
LOG_LEVEL=DEBUG brings them back); the banner with the URL and the logins comes last, once the
agent has registered. Ctrl-C (or SIGTERM) stops the agent first (while the portal can still take
its last reports), then the rest, and waits for each, so nothing is left running behind the
user's back.
"""
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from django.conf import settings
from django.core.management.base import BaseCommand
from django.utils import timezone

from portal.autoscale import localnode
from portal.autoscale.models import NodePool
from portal.autoscale.services import release_all
from portal.core.context import Actor
from portal.nodes.models import Node
from portal.nodes.services import node_add, node_rotate_token

LOCAL_NODE = "local"
JOB_IMAGE = "gpuportal/busybox:latest"


def best_sandbox() -> tuple[str, str]:
    """docker when an engine answers and has the job image; else process, which isolates nothing."""
    try:
        import docker  # the agent's SDK: a portal installed without it runs the process sandbox

        client = docker.from_env(timeout=3)
        client.ping()
        client.images.get(JOB_IMAGE)
        return "docker", "Docker engine found"
    except Exception as exc:  # no engine, no permission, no image: all mean the same here
        return "process", f"no usable Docker engine or image ({type(exc).__name__}); jobs are NOT isolated"


class Relay:
    """Children's output through this process, line by line: the banner can wait for the
    Celery workers' "ready" lines, and lines of different children never interleave mid-line."""

    READY = " ready."  # Celery's "<name>@<host> ready." once a worker consumes its queues

    def __init__(self, out):
        self.out = out
        self.lock = threading.Lock()
        self.ready: dict[str, threading.Event] = {}

    def start(self, name: str, argv: list[str], *, env: dict) -> subprocess.Popen:
        proc = subprocess.Popen(argv, start_new_session=True, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        self.ready[name] = threading.Event()
        threading.Thread(target=self._copy, args=(name, proc), daemon=True).start()
        return proc

    def _copy(self, name: str, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if self.READY in line:
                self.ready[name].set()
            with self.lock:
                self.out.write(line, ending="")
                self.out.flush()

    def wait_ready(self, names: list[str], *, children: dict, deadline_s: float) -> bool:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if all(self.ready[n].is_set() for n in names):
                return True
            if any(p.poll() is not None for p in children.values()):
                return False
            time.sleep(0.2)
        return False


def wait_registered(node_name: str, *, since, children: dict, deadline_s: float) -> bool:
    """Until the agent has registered (its first heartbeat time is after `since`) or a child died."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if Node.objects.filter(name=node_name, last_heartbeat_at__gte=since).exists():
            return True
        if any(p.poll() is not None for p in children.values()):
            return False
        time.sleep(0.3)
    return False


def wait_http(url: str, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except OSError:
            time.sleep(0.3)
    return False


DEMO_POOL = "sim"


def demo_pool(host: str, port: int, *, sandbox: str):
    """With LOCAL_AUTOSCALE_NODES=N (N > 0): a `local` node pool of up to N nodes, so the demo shows
    autoscaling (docs/autoscaling.md); None otherwise. Its nodes are released when the stack stops."""
    count = int(os.getenv("LOCAL_AUTOSCALE_NODES", "0") or 0)
    if count <= 0:
        NodePool.objects.filter(name=DEMO_POOL).update(enabled=False)
        return None
    pool, _ = NodePool.objects.update_or_create(name=DEMO_POOL, defaults={
        "provider": "local", "enabled": True, "gpu_model": "H100-80GB", "gpus_per_node": 4, "sandbox": sandbox,
        "price_per_gpu_hour": "2.50", "min_nodes": 0, "max_nodes": count, "max_per_step": count,
        "idle_release_s": 120, "boot_timeout_s": 180, "max_concurrent_releases": count,
        "provider_config": {"portal_url": f"http://{host}:{port}"}, "unavailable_until": None, "failures": 0})
    return pool


class Command(BaseCommand):
    help = "Start web + Celery worker + Celery beat + a local agent; Ctrl-C stops them all."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--host", default="127.0.0.1")

    def local_agent(self, host: str, port: int) -> tuple[list[str], str]:
        """The agent of node `local`: simulated GPUs, and Docker when an engine with the job image answers."""
        actor = Actor(user=None, label="manage.py")
        node = Node.objects.filter(name=LOCAL_NODE).first()
        if node is None:
            _, token = node_add(actor=actor, name=LOCAL_NODE)
        else:
            token = node_rotate_token(actor=actor, node=node)
        sandbox, why = best_sandbox()
        argv = [sys.executable, "-m", "agents", "--portal", f"http://{host}:{port}", "--token", token,
                "--broker", settings.CELERY_BROKER_URL, "--name", LOCAL_NODE,
                "--gpus", os.getenv("LOCAL_AGENT_GPUS", "sim:4xH100-80GB"), "--sandbox", sandbox,
                "--volumes-root", str(settings.VOLUMES_ROOT),  # one machine: the portal's own tree
                "--session-listen", "127.0.0.1:0"]  # interactive sessions' gateway, on loopback
        if settings.CELERY_BROKER_URL.startswith("filesystem://"):
            argv += ["--broker-folder", settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]]
        return argv, f"{sandbox} sandbox ({why})"

    def processes(self, host: str, port: int) -> dict[str, list[str]]:
        python = sys.executable
        var = str(settings.VAR_DIR)
        level = os.getenv("LOG_LEVEL", "INFO").upper()
        return {
            # migrate has just run the system checks.
            # uvicorn with portal.asgi: the portal's pages and API, and the interactive sessions'
            # proxy at /sessions/ (HTTP and WebSockets; docs/sessions.md).
            "web": [python, "-m", "uvicorn", "portal.asgi:application", "--host", host, "--port", str(port),
                    "--log-level", "warning", "--ws-max-size", str(settings.SESSION_MAX_FRAME_BYTES)],
            "worker": [python, "-m", "celery", "-A", "portal", "--quiet", "worker", "-Q", "default,scheduler",
                       "--concurrency", "2", "--loglevel", level, "-n", "portal@%h"],
            "beat": [python, "-m", "celery", "-A", "portal", "--quiet", "beat", "--loglevel", level,
                     "--schedule", os.path.join(var, "celerybeat-schedule")],
        }

    def handle(self, *args, host, port, **options):
        children: dict[str, subprocess.Popen] = {}
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        started_at = timezone.now()
        agent_argv, sandbox_note = self.local_agent(host, port)
        pool = demo_pool(host, port, sandbox=agent_argv[agent_argv.index("--sandbox") + 1])
        env = {
            **os.environ,
            # Django 5.2's runserver prints a paragraph about not being for production; the banner says it.
            "DJANGO_RUNSERVER_HIDE_WARNING": "true",
            # Celery warns at length when its workers run as root (a container, a VM); here they run
            # only the portal's own tasks and the agent, and jobs run as user 65534 in their sandboxes.
            "PYTHONWARNINGS": "ignore:You're running the worker with superuser privileges",
        }
        relay = Relay(self.stdout)
        for name, argv in self.processes(host, port).items():
            # Own process group: the terminal's Ctrl-C reaches us, and we stop children in order.
            children[name] = relay.start(name, argv, env=env)
        # The agent registers over HTTP at start: wait for the web server to answer first.
        if wait_http(f"http://{host}:{port}/login/", deadline_s=60):
            children["agent"] = relay.start("agent", agent_argv, env=env)
            up = (wait_registered(LOCAL_NODE, since=started_at, children=children, deadline_s=60)
                  and relay.wait_ready(["worker", "agent"], children=children, deadline_s=60))
        else:
            up = False
            self.stderr.write("the web server did not answer within 60 s; not starting the local agent")
        url = f"http://{host}:{port}/"
        self.stdout.write((self.style.SUCCESS if up else self.style.WARNING)(
            f"\ngpuportal is {'up' if up else 'starting (the local agent has not registered yet)'} at {url}  "
            f"(API docs: {url}api/docs/, admin: {url}admin/; a development server, not for production)\n"
            f"Logins (password {settings.DEMO_PASSWORD!r}): admin (staff), alice (owner acme/vision), "
            f"bob (member), dave (viewer), charlie (owner globex/nlp)\n"
            f"Local agent: node {LOCAL_NODE!r}, simulated GPUs, {sandbox_note}.\n"
            + (f"Autoscaling pool {pool.name!r}: up to {pool.max_nodes} local nodes of {pool.gpus_per_node}x"
               f"{pool.gpu_model} when jobs wait, released after {pool.idle_release_s} s idle "
               f"({url}console/autoscaling/).\n" if pool else "") +
            f"Processes: {', '.join(f'{n} pid {p.pid}' for n, p in children.items())}. Quiet log "
            f"(LOG_LEVEL=DEBUG for every pass and heartbeat). Ctrl-C stops everything.\n"))
        exit_code = 0
        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    self.stderr.write(f"{name} exited with status {proc.returncode}; stopping the rest.")
                    exit_code = 1
                    stopping = True
                    break
            time.sleep(0.5)
        if pool is not None:  # the pool's agents first: they are this command's too
            NodePool.objects.filter(pk=pool.pk).update(enabled=False)
            release_all(pool)  # idle nodes are released; busy ones stop like the local agent, jobs left to adopt
            for name in localnode.running():
                localnode.stop(name)
        # The agent first, while the web server can still take its last reports; then the rest.
        for group in (["agent"], [n for n in children if n != "agent"]):
            procs = {n: children[n] for n in group if n in children}
            for proc in procs.values():
                if proc.poll() is None:
                    # The main process only: Celery stops its own pool children in a warm shutdown.
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 15
            for name, proc in procs.items():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.stderr.write(f"{name} did not stop in time; killing it.")
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.stdout.write("All processes stopped.")
        sys.exit(exit_code)
