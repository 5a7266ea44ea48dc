"""The node lease file and the per-job supervisor loop (standard library only: see __init__.py).

Lease file: JSON ``{"deadline": <epoch s>, "fence_grace_s": <s>}``, replaced atomically. A file that
is missing or unreadable keeps the last deadline read (at start: launch time + the lease given on the
command line), so a half-broken disk never extends a lease.

Run as ``python -I -c SOURCE process EXIT_PATH LEASE_PATH LEASE_S GRACE_S -- ARGV...``: start ARGV (in
this process's session, so the sandbox's group signal reaches it), wait for it, and write its exit code
(128 + signal for a signal death, as a shell and Docker say it) to EXIT_PATH by rename. Once the lease
deadline passes: SIGTERM the group, wait the fence grace, write ``<code> lease_expired`` and SIGKILL
the group (this process with it: the record is already on disk).
"""

import json
import os
import signal
import sys
import threading
import time

CHECK_S = 0.5  # how often the deadline is re-read; the fence is at most this late
FENCED = "lease_expired"


def write_lease(path, deadline: float, fence_grace_s: float) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # the heartbeat and a launch may both write
    with open(tmp, "w") as f:
        json.dump({"deadline": deadline, "fence_grace_s": fence_grace_s}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fenced_marker(lease_path, ref: str):
    """Where a docker or kvm supervisor notes that it fenced sandbox ``ref`` (``fenced/<ref>`` beside
    the lease file), before it stops it: the engine keeps only an exit code, so a returning agent
    reads the marker to report the end as the lease's doing (a node fault), not the job's failure."""
    return os.path.join(os.path.dirname(str(lease_path)), "fenced", ref)


def mark_fenced(lease_path, ref: str) -> None:
    path = fenced_marker(lease_path, ref)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_exit(path, FENCED)


def was_fenced(lease_path, ref: str) -> bool:
    return lease_path is not None and os.path.exists(fenced_marker(lease_path, ref))


def forget_fenced(lease_path, ref: str) -> None:
    """Drop the marker with its sandbox."""
    if lease_path is None:
        return
    try:
        os.unlink(fenced_marker(lease_path, ref))
    except FileNotFoundError:
        pass


def read_lease(path) -> tuple[float, float] | None:
    """(deadline, fence grace) from the lease file, or None if missing or unreadable."""
    try:
        with open(path) as f:
            d = json.load(f)
        return float(d["deadline"]), float(d["fence_grace_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Lease:
    """The deadline as last read, re-read at most every CHECK_S."""

    def __init__(self, path, lease_s: float, grace_s: float, now=time.time):
        self.path, self._now = path, now
        self.deadline, self.grace_s = now() + lease_s, grace_s
        self.refresh()

    def refresh(self) -> None:
        got = read_lease(self.path)
        if got is not None:
            self.deadline, self.grace_s = got

    def expired(self) -> bool:
        self.refresh()
        return self._now() > self.deadline


def _write_exit(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def supervise_process(exit_path: str, lease_path: str, lease_s: float, grace_s: float, argv: list[str]) -> int:
    # Signals to the job's group reach the job; this process only notes them, so it outlives the job
    # to write the code.
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, lambda *_: None)
    import subprocess  # here: the docker and kvm supervisors import this module and need none of it

    lease = Lease(lease_path, lease_s, grace_s)
    try:
        p = subprocess.Popen(argv)
    except OSError as exc:
        print(f"gpuportal: could not start {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        _write_exit(exit_path, "127")
        return 127
    ended = _exit_waiter(p.pid)
    while True:
        # Woken by the job's exit (a pidfd), else every CHECK_S for the lease: subprocess's own wait
        # with a timeout would ask waitpid every few milliseconds for as long as the job runs.
        ended(CHECK_S)
        rc = p.poll()
        if rc is not None:
            rc = _code(rc)
            break
        if lease.expired():
            print(f"gpuportal: the node's lease ran out at {time.ctime(lease.deadline)}; stopping the job "
                  f"(SIGTERM, SIGKILL after {lease.grace_s:g}s)", file=sys.stderr, flush=True)
            os.killpg(0, signal.SIGTERM)
            try:
                rc = _code(p.wait(timeout=lease.grace_s))
            except subprocess.TimeoutExpired:
                rc = 128 + signal.SIGKILL
            _write_exit(exit_path, f"{rc} {FENCED}")
            os.killpg(0, signal.SIGKILL)  # the job's children too, and this process: the record is written
    _write_exit(exit_path, str(rc))
    return rc


def _exit_waiter(pid: int):
    """A function that waits up to its argument's seconds for process ``pid`` to exit."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (Linux before 5.3): sleep, then ask
        return time.sleep
    import select

    return lambda timeout: select.select([fd], [], [], timeout)


def main(args: list[str]) -> int:
    kind, rest = args[0], args[1:]
    if kind == "process":
        sep = rest.index("--")
        exit_path, lease_path, lease_s, grace_s = rest[:sep]
        return supervise_process(exit_path, lease_path, float(lease_s), float(grace_s), rest[sep + 1:])
    print(f"unknown supervisor kind {kind!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
