"""The node lease file and the per-job supervisor loop (standard library only: see __init__.py).

Lease file: JSON ``{"deadline": <epoch s>, "fence_grace_s": <s>}``, replaced atomically. A file that
is missing or unreadable keeps the last deadline read (at start: launch time + the lease given on the
command line), so a half-broken disk never extends a lease.

Run as ``python -I -S -c SOURCE process EXIT_PATH LEASE_PATH LEASE_S GRACE_S -- ARGV...``: start ARGV (in
this process's session, so the sandbox's group signal reaches it), wait for it, and write its exit code
(128 + signal for a signal death, as a shell and Docker say it) to EXIT_PATH by rename. Once the lease
deadline passes: SIGTERM the group, wait the fence grace, write ``<code> lease_expired`` and SIGKILL
the group (this process with it: the record is already on disk).

A process-sandbox job starts one such interpreter, so its start-up is a node's CPU per job: it imports
no json, re, subprocess, threading or enum (the lease is read by ``_parse_lease``, the job started
with ``posix_spawn``, signals numbered by ``_signal``), and ``-S`` skips ``site``: a ``true`` job
under it costs 12 ms of CPU (a bare ``python -I -S -c pass`` about 7), down from 25.
"""

import os
import sys
import time

import _signal as signal  # signal's C half: the module itself imports enum, a third of this process's start

CHECK_S = 0.5  # how often the deadline is re-read; the fence is at most this late
FENCED = "lease_expired"


def write_lease(path, deadline: float, fence_grace_s: float) -> None:
    import json  # the agent's side: the supervisors only read it
    import threading

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
            d = _parse_lease(f.read())
        return float(d["deadline"]), float(d["fence_grace_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _parse_lease(text: str) -> dict:
    """``write_lease``'s JSON, a flat object of numbers, without the json module: ValueError for
    anything else (the caller keeps the last deadline)."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError("not a JSON object")
    out = {}
    for item in text[1:-1].split(","):
        key, sep, value = item.partition(":")
        key = key.strip()
        if not sep or len(key) < 2 or key[0] != '"' or key[-1] != '"' or '"' in key[1:-1]:
            raise ValueError(f"not a key: {key!r}")
        out[key[1:-1]] = float(value)
    return out


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
    lease = Lease(lease_path, lease_s, grace_s)
    try:
        # In this process's session and group; the exec resets the handlers above, and SIGPIPE and
        # SIGXFSZ, which Python ignores, are put back to the default as subprocess would.
        pid = os.posix_spawnp(argv[0], argv, os.environ, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:
        print(f"gpuportal: could not start {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        _write_exit(exit_path, "127")
        return 127
    ended = _exit_waiter(pid)
    while True:
        # Woken by the job's exit (a pidfd), else every CHECK_S for the lease.
        ended(CHECK_S)
        rc = _reap(pid)
        if rc is not None:
            break
        if lease.expired():
            print(f"gpuportal: the node's lease ran out at {time.ctime(lease.deadline)}; stopping the job "
                  f"(SIGTERM, SIGKILL after {lease.grace_s:g}s)", file=sys.stderr, flush=True)
            os.killpg(0, signal.SIGTERM)
            deadline = time.monotonic() + lease.grace_s
            rc = _reap(pid)
            while rc is None and time.monotonic() < deadline:
                ended(min(CHECK_S, max(0.0, deadline - time.monotonic())))
                rc = _reap(pid)
            if rc is None:
                rc = 128 + signal.SIGKILL
            _write_exit(exit_path, f"{rc} {FENCED}")
            os.killpg(0, signal.SIGKILL)  # the job's children too, and this process: the record is written
    _write_exit(exit_path, str(rc))
    return rc


def _reap(pid: int) -> int | None:
    """The job's exit code (128 + signal for a signal death) once it has ended, else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped already: cannot happen with one waiter, but never hang on it
        return 255
    return None if done == 0 else _code(os.waitstatus_to_exitcode(status))


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
