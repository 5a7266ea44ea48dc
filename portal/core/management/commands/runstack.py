"""`make run`: the web server, a Celery worker, Celery beat and one local agent, in one terminal.

Ctrl-C (or SIGTERM) stops every child and waits for it, so nothing is left
running behind the user's back.
"""
import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand


LOCAL_NODE = "local"
JOB_IMAGE = "gpuportal/busybox:latest"


def best_sandbox() -> tuple[str, str]:
    """docker when an engine answers and has the job image; else process, which isolates nothing."""
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        client.images.get(JOB_IMAGE)
        return "docker", "Docker engine found"
    except Exception as exc:  # no engine, no permission, no image: all mean the same here
        return "process", f"no usable Docker engine or image ({type(exc).__name__}); jobs are NOT isolated"


def wait_http(url: str, deadline_s: float) -> bool:
    import urllib.request

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except OSError:
            time.sleep(0.3)
    return False


class Command(BaseCommand):
    help = "Start web + Celery worker + Celery beat + a local agent; Ctrl-C stops them all."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--host", default="127.0.0.1")

    def local_agent(self, host: str, port: int) -> tuple[list[str], str]:
        """The agent of node `local`: simulated GPUs, and Docker when an engine with the job image answers."""
        from portal.core.context import Actor
        from portal.nodes.models import Node
        from portal.nodes.services import node_add, node_rotate_token

        actor = Actor(user=None, label="manage.py")
        node = Node.objects.filter(name=LOCAL_NODE).first()
        if node is None:
            _, token = node_add(actor=actor, name=LOCAL_NODE)
        else:
            token = node_rotate_token(actor=actor, node=node)
        sandbox, why = best_sandbox()
        argv = [sys.executable, "-m", "agents", "--portal", f"http://{host}:{port}", "--token", token,
                "--broker", settings.CELERY_BROKER_URL, "--name", LOCAL_NODE,
                "--gpus", os.getenv("LOCAL_AGENT_GPUS", "sim:4xH100-80GB"), "--sandbox", sandbox]
        if settings.CELERY_BROKER_URL.startswith("filesystem://"):
            argv += ["--broker-folder", settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]]
        return argv, f"{sandbox} sandbox ({why})"

    def processes(self, host: str, port: int) -> dict[str, list[str]]:
        python = sys.executable
        var = str(settings.VAR_DIR)
        return {
            "web": [python, "manage.py", "runserver", f"{host}:{port}", "--noreload"],
            "worker": [python, "-m", "celery", "-A", "portal", "worker", "-Q", "default,scheduler",
                       "--concurrency", "2", "--loglevel", "INFO", "-n", "portal@%h"],
            "beat": [python, "-m", "celery", "-A", "portal", "beat", "--loglevel", "INFO",
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
        agent_argv, sandbox_note = self.local_agent(host, port)
        for name, argv in self.processes(host, port).items():
            # Own process group: the terminal's Ctrl-C reaches us, and we stop children in order.
            children[name] = subprocess.Popen(argv, start_new_session=True)
        # The agent registers over HTTP at start: wait for the web server to answer first.
        if wait_http(f"http://{host}:{port}/login/", deadline_s=60):
            children["agent"] = subprocess.Popen(agent_argv, start_new_session=True)
        else:
            self.stderr.write("the web server did not answer within 60 s; not starting the local agent")
        url = f"http://{host}:{port}/"
        self.stdout.write(self.style.SUCCESS(
            f"\ngpuportal is starting at {url}  (API docs: {url}api/docs/, admin: {url}admin/)\n"
            f"Logins (password {settings.DEMO_PASSWORD!r}): admin (staff), alice (owner acme/vision), "
            f"bob (member), dave (viewer), charlie (owner globex/nlp)\n"
            f"Local agent: node {LOCAL_NODE!r}, simulated GPUs, {sandbox_note}.\n"
            f"Processes: {', '.join(f'{n} pid {p.pid}' for n, p in children.items())}. Ctrl-C stops everything.\n"))
        exit_code = 0
        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    self.stderr.write(f"{name} exited with status {proc.returncode}; stopping the rest.")
                    exit_code = 1
                    stopping = True
                    break
            time.sleep(0.5)
        for proc in children.values():
            if proc.poll() is None:
                # The main process only: Celery stops its own pool children in a warm shutdown.
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for name, proc in children.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{name} did not stop in time; killing it.")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.stdout.write("All processes stopped.")
        sys.exit(exit_code)
