"""A container's output as a byte stream the agent reads a little at a time (docker sandbox).

The engine has no byte-offset API: ``docker logs`` returns whole messages (a line, or a 16 KiB
part of a longer one), each with the time the engine took it. Re-reading the whole log on every
pass costs as much as the log is long, each pass, so a ``ContainerLog`` asks only for messages
since a time (``since``, with timestamps), keeps what the agent has not taken yet, and reads at
most ``READ_MAX_BYTES`` at a time (the rest stays in the engine's log file, which the driver caps
with json-file's max-size and max-file).

``since`` filters by the time a message was stamped, but the file is in the order messages were
written: the engine stamps each message in the goroutine copying its stream (stdout or stderr),
then takes the file's lock and writes it, so a goroutine held up in between writes its message
after newer ones of the other stream. That happens most to a stream's first message, when its
goroutine first wakes: on a loaded node a job's first stdout line landed after more than 20 ms of
its stderr lines. A message the engine had not written when a read asked at time ``t`` is written
after ``t``, so it was stamped after ``t - MARGIN_NS`` unless the engine held it that long; one
written after a message stamped ``s`` was stamped after ``s - MARGIN_NS``. Each read therefore
asks from the later of the two (the *floor*, which only rises), and skips the messages it already
has, matched by time and content.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from collections import Counter

READ_MAX_BYTES = 1024 * 1024  # one read returns at most this; the agent reads on
# How long the engine may hold a message between stamping and writing it (above). Usually under
# 5 ms, but past 20 ms on a loaded node; what was printed within it before a read is sent again by
# the engine on the next read (and skipped), so a job that prints steadily costs at most this much
# of its output again per read, and one that stopped printing costs nothing once it has passed.
MARGIN_NS = 1_000_000_000
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
        self.floor_ns: int | None = None  # no message not read yet is stamped before this (None: all may be)
        self.recent: Counter = Counter()  # (time, payload) of the messages read stamped at or after the floor

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
        floor = self.floor_ns
        seen = Counter(self.recent)  # already read: each is skipped once when met again
        budget, got, ended = READ_MAX_BYTES - len(self.buf), 0, True
        asked_ns = time.time_ns()  # what the engine has not written by now, it writes after this
        stream = log_frames(container, floor)
        try:
            for frame in stream:
                stamp, _, payload = frame.partition(b" ")
                ns = _timestamp_ns(stamp)
                if ns is None:  # not a stamped message (never seen from the engine): keep it all
                    ns, payload = self.newest_ns or floor or 0, frame
                self.newest_ns = max(ns, self.newest_ns or ns)
                # Only against the floor this read asked from: within one read the engine sends each
                # message once, even one stamped long before the newest read so far.
                if floor is not None and ns < floor:
                    continue
                if seen[(ns, payload)]:
                    seen[(ns, payload)] -= 1
                    continue
                self.buf += payload
                self.recent[(ns, payload)] += 1
                got += len(payload)
                if got >= budget:
                    ended = False
                    break
        finally:
            close = getattr(stream, "close", None)
            if close:
                close()
        # What is left unread was written after the newest message read, and, when this read got to
        # the end, after it asked.
        bound = max(asked_ns, self.newest_ns or 0) if ended else self.newest_ns
        self.floor_ns = max(bound - MARGIN_NS, self.floor_ns or 1)
        self.recent = Counter({k: n for k, n in self.recent.items() if k[0] >= self.floor_ns})
        return got > 0


def log_frames(container, since_ns: int | None):
    """The container's stamped log messages (stdout and stderr, stamped at or after ``since_ns`` when
    given, in the order the engine wrote them) as a stream: ``container.logs(stream=True,
    timestamps=True, since=...)`` without the inspect the docker SDK makes before every read to
    learn whether the container has a TTY. A job's container never has one (the driver creates
    none), and that inspect doubled the engine calls of shipping a running job's log, every pass,
    for every job."""
    import docker.types

    api = container.client.api
    params = {"stdout": 1, "stderr": 1, "timestamps": 1, "follow": 0, "tail": "all"}
    if since_ns is not None:  # seconds.nanoseconds, exactly: a float would round it up or down
        params["since"] = f"{since_ns // 1_000_000_000}.{since_ns % 1_000_000_000:09d}"
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
