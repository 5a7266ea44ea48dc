"""The docker sandbox's logs against the real engine: rotated json-file logs, incremental reads."""

import time

import pytest

from agents.sandbox import RUNNING, docker_logs
from agents.sandbox.docker_logs import READ_MAX_BYTES, _timestamp_ns
from tests.agents.conftest import make_spec, wait_done


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
