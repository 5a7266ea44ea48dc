"""The node lease file and the per-job supervisor loop (standard library only: see __init__.py).

Lease file: JSON ``{"deadline": <epoch s>, "fence_grace_s": <s>}``, replaced atomically. A file that
is missing or unreadable keeps the last deadline read (at start: launch time + the lease given on the
command line), so a half-broken disk never extends a lease.

Run as ``python -I -S -c SOURCE process EXIT_PATH LEASE_PATH LEASE_S GRACE_S -- ARGV...``: start ARGV (in
this process's session, so the sandbox's group signal reaches it), wait for it, and write its exit code
(128 + signal for a signal death, as a shell and Docker say it) to EXIT_PATH by rename. Once the lease
deadline passes: SIGTERM the group, wait the fence grace, write ``<code> lease_expired`` and SIGKILL
the group (this process with it: the record is already on disk).

The process sandbox runs one interpreter per agent, ``... spawner`` (``serve_spawns``), which forks
each job's supervisor: a ``true`` job costs about 3.4 ms of CPU with it, supervisor and job,
where an interpreter per job cost 12 (and 25 before this file imported no json, re, subprocess,
threading or enum: the lease is read by ``_parse_lease``, the job started with ``posix_spawn``,
signals numbered by ``_signal``; ``-S`` skips ``site``). ``process`` runs one job's supervisor in
an interpreter of its own.
"""

import os
import sys
import time

import _signal as signal  # signal's C half: the module itself imports enum, a third of this process's start

CHECK_S = 0.5  # how often the deadline is re-read; the fence is at most this late
NOTED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)  # the job's, not ours
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


def supervise_process(exit_path: str, lease_path: str, lease_s: float, grace_s: float, argv: list[str],
                      started_fd: int | None = None) -> int:
    """Run the job to its end (see the module's doc). ``started_fd``, if given, is closed once the
    job has been started (or could not be): the spawner answers the agent only then."""
    # Signals to the job's group reach the job; this process only notes them, so it outlives the job
    # to write the code.
    for s in NOTED:
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
    finally:
        if started_fd is not None:
            os.close(started_fd)
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


def serve_spawns() -> int:
    """The process sandbox's node spawner: one long-lived process per agent that forks each job's
    supervisor, so a job costs a fork (about 2.5 ms of CPU with its supervisor's work) instead of an
    interpreter's start (12 ms).

    Requests arrive on stdin, one JSON object a line (``exit``, ``lease``, ``lease_s``, ``grace_s``,
    ``cwd``, ``log``, ``env``, ``argv``); each is answered on stdout with the child's pid, or ``error``
    and a reason. The child leads a session of its own (the sandbox's group, as before), works in
    ``cwd``, writes to ``log`` and runs ``supervise_process``. The spawner reaps its children as they
    end; one that died without writing its exit record (SIGKILL to the group) gets one from its wait
    status, as a parent's waitpid would have said it. End of input (the agent gone) ends the spawner
    and nothing else: the children are in sessions of their own and live on."""
    import json
    import select

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of each exit
    exits: dict[int, str] = {}
    pending = b""
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap_children(exits)
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 20)
        if not data:
            return 0
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                req = json.loads(line)
                exit_path = req["exit"]
            except (ValueError, KeyError, TypeError) as exc:
                os.write(1, f"error {exc!r}\n".encode())
                continue
            started_r, started_w = os.pipe()
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(started_r)
                os.close(started_w)
                os.write(1, f"error {exc!r}\n".encode())
                continue
            if pid == 0:
                _spawned(req, started_w)  # never returns
            exits[pid] = exit_path
            # Answered once the job runs in the child's session: a stop right after the launch reaches it.
            os.close(started_w)
            os.read(started_r, 1)
            os.close(started_r)
            os.write(1, f"{pid}\n".encode())


def _reap_children(exits: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exits.pop(pid, None)
        if path is not None and not os.path.exists(path):
            try:
                _write_exit(path, str(_code(os.waitstatus_to_exitcode(status))))
            except OSError:  # the sandbox folder was removed meanwhile
                pass


def _spawned(req: dict, started_w: int) -> None:
    """The forked child: the job's supervisor, in a session of its own. It closes ``started_w`` once
    the job has started (a failure before that closes it by the child's exit)."""
    rc = 127
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for s in NOTED:
            signal.signal(s, lambda *_: None)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, started_w)
        os.closerange(started_w + 1, 1 << 16)
        os.chdir(req["cwd"])
        os.environ.clear()  # posix_spawnp searches the job's PATH, as the job sees its environment
        os.environ.update(req["env"])
        rc = supervise_process(req["exit"], req["lease"], float(req["lease_s"]), float(req["grace_s"]),
                               req["argv"], started_fd=started_w)
    except BaseException as exc:
        try:
            os.write(2, f"gpuportal: could not start the job's supervisor: {exc}\n".encode())
        except OSError:
            pass
    os._exit(rc)


def main(args: list[str]) -> int:
    kind, rest = args[0], args[1:]
    if kind == "spawner":
        return serve_spawns()
    if kind == "process":
        sep = rest.index("--")
        exit_path, lease_path, lease_s, grace_s = rest[:sep]
        return supervise_process(exit_path, lease_path, float(lease_s), float(grace_s), rest[sep + 1:])
    print(f"unknown supervisor kind {kind!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
