"""`make run`: the web server, a Celery worker and Celery beat, in one terminal.

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


class Command(BaseCommand):
    help = "Start web + Celery worker + Celery beat for local use; Ctrl-C stops them all."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--host", default="127.0.0.1")

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
        for name, argv in self.processes(host, port).items():
            # Own process group: the terminal's Ctrl-C reaches us, and we stop children in order.
            children[name] = subprocess.Popen(argv, start_new_session=True)
        url = f"http://{host}:{port}/"
        self.stdout.write(self.style.SUCCESS(
            f"\ngpuportal is starting at {url}  (API docs: {url}api/docs/, admin: {url}admin/)\n"
            f"Logins (password {settings.DEMO_PASSWORD!r}): admin (staff), alice (owner acme/vision), "
            f"bob (member), dave (viewer), charlie (owner globex/nlp)\n"
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
