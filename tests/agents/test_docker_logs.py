"""The docker sandbox's logs against the real engine: rotated json-file logs, incremental reads; and
the reads against a log written out of stamp order, as a loaded engine writes it."""

import datetime
import time

import pytest

from agents.sandbox import RUNNING, docker_logs
from agents.sandbox.docker_logs import MARGIN_NS, READ_MAX_BYTES, ContainerLog, _timestamp_ns
from tests.agents.conftest import make_spec, wait_done
from tests.procs import wait_for

MS = 1_000_000


def read_all(driver, handle, offset=0):
    """Everything from ``offset`` on, read the way the agent does: on from where the last read ended."""
    out = bytearray()
    while chunk := driver.read_logs(handle, offset + len(out)):
        out += chunk
    return bytes(out)


@pytest.fixture
def engine_reads(docker_driver, monkeypatch):
    """Bytes the engine sent for each `docker logs` request the driver made."""
    calls = []
    real_frames = docker_logs.log_frames

    def log_frames(container, since):
        calls.append(0)
        inner = real_frames(container, since)

        def frames():
            try:
                for frame in inner:
                    calls[-1] += len(frame)
                    yield frame
            finally:
                inner.close()
        return frames()

    monkeypatch.setattr(docker_logs, "log_frames", log_frames)
    return calls


def test_job_logs_are_json_file_with_rotation(docker_driver, docker_client):
    h = docker_driver.launch(make_spec(command=["true"]))
    cfg = docker_client.api.inspect_container(h.ref)["HostConfig"]["LogConfig"]
    assert cfg == {"Type": "json-file", "Config": {"max-size": "10m", "max-file": "3"}}


def test_reads_ask_the_engine_only_for_what_is_new(docker_driver, docker_client, engine_reads):
    # ~390 KB at once; then, each when the test says so, a mark and one more line.
    wait = "while [ ! -e /tmp/{0} ]; do sleep 0.05; done"
    h = docker_driver.launch(make_spec(command=[
        "sh", "-c", f"seq 1 60000; {wait.format('go1')}; echo mark; {wait.format('go2')}; echo tail"]))
    container = docker_client.containers.get(h.ref)
    expected = "".join(f"{i}\n" for i in range(1, 60001)).encode()
    deadline = time.monotonic() + 60
    got = b""
    while got != expected:
        assert time.monotonic() < deadline and len(got) <= len(expected), f"{len(got)} bytes read: {got[-50:]!r}"
        got += read_all(docker_driver, h, len(got))
    first = sum(engine_reads)
    container.exec_run(["touch", "/tmp/go1"], user="65534")
    while not got.endswith(b"mark\n"):
        assert time.monotonic() < deadline
        got += read_all(docker_driver, h, len(got))
    # Reads ask again for what was printed within MARGIN_NS before them; once that has passed, a
    # read is sent nothing.
    wait_for(lambda: read_all(docker_driver, h, len(got)) == b"" and engine_reads[-1] == 0,
             what="a read the engine sends nothing")
    engine_reads.clear()
    container.exec_run(["touch", "/tmp/go2"], user="65534")
    wait_done(docker_driver, h)
    assert read_all(docker_driver, h, len(got)) == b"tail\n"
    # The 390 KB already read were not sent again: each request began after them.
    assert sum(engine_reads) < 2000 and first >= len(expected)


def test_a_read_is_bounded_and_the_agent_reads_on(docker_driver):
    h = docker_driver.launch(make_spec(command=["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x; echo"],
                                       memory_mb=128))
    wait_done(docker_driver, h)
    first = docker_driver.read_logs(h, 0)
    assert 0 < len(first) <= READ_MAX_BYTES
    assert read_all(docker_driver, h) == b"x" * 3000000 + b"\n"


def test_incremental_reads_keep_every_line_of_both_streams(docker_driver):
    """Lines printed fast on stdout and stderr, read in small steps while the job runs: none lost,
    none twice, each stream in its order."""
    h = docker_driver.launch(make_spec(command=[
        "sh", "-c", "for i in $(seq 1 3000); do echo out$i; echo err$i >&2; done"]))
    out, deadline = bytearray(), time.monotonic() + 60
    while True:
        running = docker_driver.poll(h)[0] == RUNNING
        out += docker_driver.read_logs(h, len(out))[:5000]  # the agent may take only part of a read
        if not running and not docker_driver.read_logs(h, len(out)):
            break
        assert time.monotonic() < deadline
    lines = out.decode().splitlines()
    assert [x for x in lines if x.startswith("out")] == [f"out{i}" for i in range(1, 3001)]
    assert [x for x in lines if x.startswith("err")] == [f"err{i}" for i in range(1, 3001)]
    # Going back (an agent re-shipping from 0 after a restart) reads it all again.
    assert read_all(docker_driver, h) == bytes(out)


def test_engine_timestamps_parse_to_nanoseconds():
    assert _timestamp_ns(b"1970-01-01T00:00:01.000000002Z") == 1_000_000_002
    assert _timestamp_ns(b"1970-01-01T00:00:01.5Z") == 1_500_000_000
    assert _timestamp_ns(b"1970-01-01T01:00:01+01:00") == 1_000_000_000
    assert _timestamp_ns(b"not a time") is None


class WrittenLate:
    """A json-file log as the engine serves it: messages in the order they were written, each with the
    time it was stamped, and ``since`` comparing stamps. Counts the messages sent per request."""

    def __init__(self, monkeypatch):
        self.file: list[tuple[int, bytes]] = []
        self.sent: list[int] = []
        monkeypatch.setattr(docker_logs, "log_frames", self.log_frames)

    def write(self, stamped_ns: int, line: bytes) -> None:
        self.file.append((stamped_ns, line))

    def log_frames(self, container, since_ns):
        self.sent.append(0)
        for ns, line in list(self.file):
            if since_ns is None or ns >= since_ns:
                self.sent[-1] += 1
                when = datetime.datetime.fromtimestamp(ns // 1_000_000_000, datetime.timezone.utc)
                yield when.strftime("%Y-%m-%dT%H:%M:%S").encode() + b".%09dZ " % (ns % 1_000_000_000) + line


def read_on(log: ContainerLog, out: bytearray) -> bytes:
    """Read ``log`` on from the end of ``out`` as the agent does, until nothing more is there."""
    while chunk := log.read(None, len(out)):
        out += chunk
    return bytes(out)


def test_a_first_line_the_engine_writes_after_newer_lines_is_read(monkeypatch):
    """A loaded engine stamped a job's first stdout line, then wrote stderr lines stamped 30 ms later
    before it: the read after it is written still asks back far enough for it."""
    engine, log, out, t = WrittenLate(monkeypatch), ContainerLog(), bytearray(), time.time_ns()
    engine.write(t + 30 * MS, b"err1\n")
    engine.write(t + 31 * MS, b"err2\n")
    assert read_on(log, out) == b"err1\nerr2\n"
    engine.write(t, b"out1\n")
    engine.write(t + 32 * MS, b"out2\n")
    assert read_on(log, out) == b"err1\nerr2\nout1\nout2\n"


def test_one_read_keeps_a_line_stamped_before_newer_ones_it_got(monkeypatch):
    engine, log, out, t = WrittenLate(monkeypatch), ContainerLog(), bytearray(), time.time_ns()
    engine.write(t + 30 * MS, b"err1\n")
    engine.write(t, b"out1\n")
    assert read_on(log, out) == b"err1\nout1\n"
    engine.write(t + 40 * MS, b"out2\n")
    assert read_on(log, out) == b"err1\nout1\nout2\n"


def test_equal_messages_at_one_time_are_each_read_once_across_bounded_reads(monkeypatch):
    """The engine stamps the 16 KiB parts of a long line alike; reads cut off by READ_MAX_BYTES go
    back to that time and skip exactly the parts they have."""
    monkeypatch.setattr(docker_logs, "READ_MAX_BYTES", 8)
    engine, log, out, t = WrittenLate(monkeypatch), ContainerLog(), bytearray(), time.time_ns()
    for _ in range(5):
        engine.write(t, b"part")
    engine.write(t, b"end\n")
    assert read_on(log, out) == b"part" * 5 + b"end\n"
    engine.write(t + 1, b"part")
    assert read_on(log, out) == b"part" * 5 + b"end\npart"


def test_a_read_after_the_margin_is_sent_only_what_is_new(monkeypatch):
    engine, log, out = WrittenLate(monkeypatch), ContainerLog(), bytearray()
    t = time.time_ns() - 5 * MARGIN_NS
    for i in range(100):
        engine.write(t + i * MS, b"%d\n" % i)
    read_on(log, out)
    engine.sent.clear()
    assert log.read(None, len(out)) == b"" and engine.sent == [0]
    engine.write(time.time_ns(), b"new\n")
    assert log.read(None, len(out)) == b"new\n" and engine.sent[-1] == 1
