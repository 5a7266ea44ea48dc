"""Processes a test starts: each in its own process group, stopped with everything it spawned.

A Celery worker or an agent left running after a failed test keeps consuming queues and running
passes on the test database, and breaks later tests. So every test that starts a process starts
it here, inside a fixture whose cleanup calls `stop_process` whatever happened.
"""
import os
import signal
import subprocess
import time


def start_process(argv, **kwargs) -> subprocess.Popen:
    """Popen in a new session: the whole group (pool children included) can be signalled at once."""
    return subprocess.Popen(argv, start_new_session=True, **kwargs)


def stop_process(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, wait up to `grace_s`, then SIGKILL the group. Never raises."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already
        try:
            proc.wait(grace_s if sig == signal.SIGTERM else 10)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; children that outlived it still belong to the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return


def wait_for(pred, timeout=30.0, what="a condition", *, interval=0.2, fail=True):
    """Poll `pred` every `interval` s until it returns something true (returned), else fail after
    `timeout` (or return None with fail=False)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(interval)
    if not fail:
        return None
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
