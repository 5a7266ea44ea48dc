"""`make run`'s runstack as a new user sees it: quiet while idle, the banner last, and Ctrl-C stops
the agent before the web server (no heartbeat failures at the end), leaving no process behind."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.procs import start_process, stop_process

REPO = Path(__file__).resolve().parents[2]
BANNER_END = "Ctrl-C stops everything."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quiet_idle_banner_last_agent_stopped_first(tmp_path):
    # The embedded default, as `make run` has it: SQLite and the filesystem broker under var/.
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL")}
    env.update(DEBUG="1", GPUPORTAL_VAR_DIR=str(tmp_path / "var"), NODE_HEARTBEAT_INTERVAL_S="1",
               LOG_LEVEL="INFO")
    for argv in (["migrate", "--noinput", "-v", "0"], ["seed_demo"]):
        subprocess.run([sys.executable, "manage.py", *argv], cwd=REPO, env=env, check=True, capture_output=True,
                       timeout=300)
    out_path = tmp_path / "runstack.log"
    out = open(out_path, "w")
    proc = start_process([sys.executable, "manage.py", "runstack", "--port", str(free_port())], cwd=REPO, env=env,
                         stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while BANNER_END not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()[-3000:]
            time.sleep(0.2)
        text = out_path.read_text()
        assert "gpuportal is up at" in text, text[-3000:]
        # The banner comes after the workers and the agent are ready, and no Celery banner came at all.
        assert text.index("agent@local ready.") < text.index("gpuportal is up at")
        assert "[queues]" not in text and "[tasks]" not in text
        pids += [int(p) for p in re.findall(r"\w+ pid (\d+)", text[text.index("Processes:"):])]
        assert len(pids) == 4
        # Idle with a heartbeat a second and a pass every 5 s: nothing routine reaches the log.
        before = len(text.splitlines())
        time.sleep(12)
        idle = out_path.read_text().splitlines()[before:]
        routine = [line for line in idle if re.search(r"heartbeat|schedule_pass|Sending due task|received", line)]
        assert routine == [] and len(idle) <= 2, idle
        # Ctrl-C: the terminal signals runstack's foreground group, that is runstack itself.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        text = out_path.read_text()
        assert "heartbeat failed" not in text and "All processes stopped." in text, text[-3000:]
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"process {pid} outlived runstack")
    finally:
        stop_process(proc)
        # runstack's children have sessions of their own: a failed test must not leave them running.
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        out.close()
