"""A container's output as a byte stream the agent reads a little at a time (docker sandbox).

The engine has no byte-offset API: ``docker logs`` returns whole messages (a line, or a 16 KiB
part of a longer one), each with the time the engine took it. Re-reading the whole log on every
pass costs as much as the log is long, each pass, so a ``ContainerLog`` asks only for messages
since the newest one it has read (``since``, with timestamps), keeps what the agent has not taken
yet, and reads at most ``READ_MAX_BYTES`` at a time (the rest stays in the engine's log file,
which the driver caps with json-file's max-size and max-file).

``since`` is inclusive and the engine stamps stdout and stderr in two goroutines, so a message may
land in the file just after a newer one. Each read therefore goes back ``MARGIN_NS`` before the
newest message read and skips the messages it already has, matched by time and content.
"""

from __future__ import annotations

import datetime
import re
import threading
from collections import Counter

READ_MAX_BYTES = 1024 * 1024  # one read returns at most this; the agent reads on
# How far back each read looks again for messages stamped out of order (microseconds apart in
# practice); a burst printed within it is sent twice by the engine, so it stays short.
MARGIN_NS = 20_000_000
_TS = re.compile(rb"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


class ContainerLog:
    """What has been read of one container's log and not yet taken by the agent."""

    def __init__(self, prefix: bytes = b""):
        self.prefix = prefix  # bytes the driver puts before the job's output (a notice)
        self.lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.base = 0  # stream offset of buf[0]
        self.buf = bytearray(self.prefix)
        self.newest_ns: int | None = None  # time of the newest message read
        self.recent: Counter = Counter()  # (time, payload) of the messages read within the margin

    def read(self, container, offset: int) -> bytes:
        """The output from byte ``offset`` on, at most READ_MAX_BYTES of it; b"" when nothing more
        is there for now. ``offset`` only grows, except when the agent starts over (a re-ship)."""
        with self.lock:
            if offset < self.base:
                self._reset()  # asked for bytes already dropped: read the log again from its start
            while offset - self.base > len(self.buf):  # the agent is ahead of what was read
                self.base += len(self.buf)
                self.buf.clear()
                if not self._fetch(container):
                    return b""
            del self.buf[:offset - self.base]
            self.base = offset
            if len(self.buf) < READ_MAX_BYTES:
                self._fetch(container)
            return bytes(self.buf[:READ_MAX_BYTES])

    def _fetch(self, container) -> bool:
        """Append the messages not read yet, up to READ_MAX_BYTES; False when there were none."""
        since = max(1e-9, (self.newest_ns - MARGIN_NS) / 1e9) if self.newest_ns is not None else None
        seen = Counter(self.recent)  # already read: each is skipped once when met again
        budget, got = READ_MAX_BYTES - len(self.buf), 0
        stream = log_frames(container, since)
        try:
            for frame in stream:
                stamp, _, payload = frame.partition(b" ")
                ns = _timestamp_ns(stamp)
                if ns is None:  # not a stamped message (never seen from the engine): keep it all
                    ns, payload = self.newest_ns or 0, frame
                if self.newest_ns is not None and ns < self.newest_ns - MARGIN_NS:
                    continue
                if seen[(ns, payload)]:
                    seen[(ns, payload)] -= 1
                    continue
                self.buf += payload
                self.recent[(ns, payload)] += 1
                self.newest_ns = max(ns, self.newest_ns or ns)
                got += len(payload)
                if got >= budget:
                    break
        finally:
            close = getattr(stream, "close", None)
            if close:
                close()
        if self.newest_ns is not None:
            floor = self.newest_ns - MARGIN_NS
            self.recent = Counter({k: n for k, n in self.recent.items() if k[0] >= floor})
        return got > 0


def log_frames(container, since: float | None):
    """The container's stamped log messages (stdout and stderr, since ``since`` when given) as a
    stream: ``container.logs(stream=True, timestamps=True, since=...)`` without the inspect the
    docker SDK makes before every read to learn whether the container has a TTY. A job's
    container never has one (the driver creates none), and that inspect doubled the engine calls
    of shipping a running job's log, every pass, for every job."""
    import docker.types

    api = container.client.api
    params = {"stdout": 1, "stderr": 1, "timestamps": 1, "follow": 0, "tail": "all"}
    if since is not None:
        params["since"] = since
    res = api._get(api._url("/containers/{0}/logs", container.id), params=params, stream=True)
    return docker.types.CancellableStream(api._get_result_tty(True, res, False), res)


def _timestamp_ns(stamp: bytes) -> int | None:
    """The engine's RFC 3339 time (``2024-05-01T12:00:00.123456789Z``) in nanoseconds since the epoch."""
    m = _TS.fullmatch(stamp)
    if not m:
        return None
    head, frac, zone = m.groups()
    zone = b"+00:00" if zone == b"Z" else zone
    try:
        seconds = int(datetime.datetime.fromisoformat((head + zone).decode()).timestamp())
    except ValueError:
        return None
    return seconds * 1_000_000_000 + int((frac or b"0").ljust(9, b"0"))
