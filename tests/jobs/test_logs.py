"""Job logs: any bytes in, a capped store, pages by range out (API, pages), and a job whose output
the portal once refused still ends at its time limit (a real agent, process and docker sandboxes)."""
import base64
import time
import uuid

import pytest
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Job, JobLogChunk
from portal.jobs.reports import log_notice
from portal.jobs.services import job_submit
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"


@pytest.fixture
def node(demo):
    node, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    client.node, client.secret = node, secret
    return client


@pytest.fixture
def placed(node, demo, sent):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}})
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned"
    return job


def ship(node, job, offset, raw: bytes, attempt=1):
    return node.post(f"/api/agent/v1/jobs/{job.pk}/logs", format="json", data={
        "attempt": attempt, "offset": offset, "data_base64": base64.b64encode(raw).decode()})


def stored(job, attempt=1) -> bytes:
    return b"".join(bytes(d) for d in JobLogChunk.objects.filter(job=job, attempt=attempt)
                    .order_by("offset").values_list("data", flat=True))


def test_any_bytes_are_stored_exactly_and_served_safely(node, placed, api):
    raw = b"nul\x00 bad\xff\xfe cut\xe2\x82 ok \xe2\x9c\x93\n"
    r = ship(node, placed, 0, raw)
    assert r.status_code == 200 and r.json() == {"stored": True, "size": len(raw), "full": False}
    assert stored(placed) == raw
    page = api("alice").get(f"/api/v1/jobs/{placed.pk}/logs/").json()
    assert page["data"] == "nul\ufffd bad\ufffd\ufffd cut\ufffd ok \u2713\n" and "\x00" not in page["data"]
    assert page["next_offset"] == page["size"] == len(raw)
    # Text chunks (an older agent) may hold NUL too.
    r = node.post(f"/api/agent/v1/jobs/{placed.pk}/logs", format="json",
                  data={"attempt": 1, "offset": len(raw), "data": "a\x00b"})
    assert r.status_code == 200 and stored(placed).endswith(b"a\x00b")


@pytest.mark.parametrize("body, field", [
    ({"attempt": 1, "offset": 0}, "data"),
    ({"attempt": 1, "offset": 0, "data": "x", "data_base64": "eA=="}, "data"),
    ({"attempt": 1, "offset": 0, "data_base64": "not base64!"}, "data_base64"),
    ({"attempt": 1, "offset": -1, "data": "x"}, "offset"),
    ({"attempt": 1, "offset": 2**80, "data": "x"}, "offset"),
])
def test_bad_chunks_are_refused_with_the_field(node, placed, body, field):
    r = node.post(f"/api/agent/v1/jobs/{placed.pk}/logs", format="json", data=body)
    assert r.status_code == 400 and field in r.json()["error"]["fields"]
    assert not JobLogChunk.objects.exists()


def test_reshipped_and_overlapping_chunks_add_only_new_bytes(node, placed):
    assert ship(node, placed, 0, b"hello ").json()["stored"] is True
    assert ship(node, placed, 0, b"hello ").json() == {"stored": False, "size": 6, "full": False}
    # A restarted agent sends the log again from 0 in other chunk sizes.
    assert ship(node, placed, 0, b"hello world\n").json() == {"stored": True, "size": 12, "full": False}
    assert ship(node, placed, 3, b"lo world\nbye\n").json()["size"] == 16
    assert stored(placed) == b"hello world\nbye\n"


def test_a_log_past_the_cap_keeps_its_head_and_says_so(node, placed, api, settings):
    settings.JOB_LOG_MAX_BYTES = 4096
    notice = log_notice(4096)
    for i in range(3):
        ship(node, placed, i * 2000, b"%d" % i * 2000)
    r = ship(node, placed, 6000, b"3" * 2000)
    assert r.json() == {"stored": False, "size": 4096, "full": True}  # the agent stops shipping
    log = stored(placed)
    assert len(log) == 4096 and log.endswith(notice) and b"JOB_LOG_MAX_BYTES" in notice
    assert log == (b"0" * 2000 + b"1" * 2000)[:4096 - len(notice)] + notice
    page = api("alice").get(f"/api/v1/jobs/{placed.pk}/logs/").json()
    assert page["truncated"] is True and page["data"].endswith(notice.decode()) and page["size"] == 4096
    html = api("alice").get(f"/jobs/{placed.pk}/").content.decode()
    assert "reached the portal's limit per attempt" in html


def test_a_chunk_far_past_the_cap_still_ends_the_log_at_the_cap(node, placed, settings):
    settings.JOB_LOG_MAX_BYTES = 4096
    ship(node, placed, 0, b"head\n")
    assert ship(node, placed, 2**40, b"x" * 10).json() == {"stored": True, "size": 4096, "full": True}
    log = stored(placed)
    assert log.startswith(b"head\n") and log.endswith(log_notice(4096)) and len(log) < 4096  # the gap is no bytes


def test_the_cap_never_cuts_a_character(node, placed, settings):
    settings.JOB_LOG_MAX_BYTES = 4096
    notice = log_notice(4096)
    ship(node, placed, 0, "✓".encode() * 2000)  # 3 bytes each: the cut falls inside one
    head = stored(placed)[:-len(notice)]
    assert head.decode() == "✓" * (len(head) // 3) and len(head) % 3 == 0


def test_logs_page_by_range(node, placed, api):
    text = "line 1\n" + "é" * 10 + "\nend\n"
    raw = text.encode()
    ship(node, placed, 0, raw[:9])
    ship(node, placed, 9, raw[9:])
    client = api("alice")
    url = f"/api/v1/jobs/{placed.pk}/logs/"
    r = client.get(url, {"offset": 0, "limit": 8}).json()
    assert (r["data"], r["offset"], r["next_offset"], r["size"]) == ("line 1\n", 0, 7, len(raw))
    # A page never ends inside a character: "é" is 2 bytes, 7 + 5 would cut the third.
    r = client.get(url, {"offset": 7, "limit": 5}).json()
    assert r["data"] == "éé" and r["next_offset"] == 11
    pages, offset = [], 0
    while offset < len(raw):
        r = client.get(url, {"offset": offset, "limit": 5}).json()
        pages.append(r["data"])
        offset = r["next_offset"]
    assert "".join(pages) == text
    r = client.get(url, {"offset": len(raw) + 50}).json()
    assert r["data"] == "" and r["next_offset"] == len(raw) + 50 and r["complete"] is False


@pytest.mark.parametrize("query, field", [
    ({"offset": "x"}, "offset"), ({"offset": -1}, "offset"), ({"limit": 0}, "limit"),
    ({"limit": 2 * 1024 * 1024}, "limit"), ({"attempt": 2**40}, "attempt"), ({"offset": "²"}, "offset"),
])
def test_bad_ranges_are_400_with_the_field(placed, api, query, field):
    r = api("alice").get(f"/api/v1/jobs/{placed.pk}/logs/", query)
    assert r.status_code == 400 and field in r.json()["error"]["fields"]


def test_an_outsider_gets_404(placed, api, node):
    ship(node, placed, 0, b"secret\n")
    assert api("charlie").get(f"/api/v1/jobs/{placed.pk}/logs/").status_code == 404
    assert api("charlie").get(f"/jobs/{placed.pk}/log/").status_code == 404


def test_the_page_opens_on_the_tail_and_the_raw_log_has_all(node, placed, monkeypatch):
    from django.test import Client

    monkeypatch.setattr("portal.jobs.views.LOG_TAIL_BYTES", 64)
    lines = b"".join(b"line %03d <b>\n" % i for i in range(50))
    ship(node, placed, 0, lines + b"\x00\n")
    browser = Client()
    browser.force_login(placed.user)
    page = browser.get(f"/jobs/{placed.pk}/").content.decode()
    assert "line 049 &lt;b&gt;" in page and "line 010" not in page and "first " in page
    assert f"offset={len(lines) + 2}" in page  # the poller asks for what follows
    raw = browser.get(f"/jobs/{placed.pk}/log/")
    assert raw["Content-Type"].startswith("text/plain")
    assert b"".join(raw.streaming_content) == (lines + b"\xef\xbf\xbd\n")  # NUL served as U+FFFD


def test_the_log_poll_catches_up_a_page_at_a_time(node, placed):
    from django.test import Client

    chunk = 600 * 1024
    ship(node, placed, 0, b"a" * chunk)
    ship(node, placed, chunk, b"b" * chunk)
    browser, hx = Client(), {"HX-Request": "true"}
    browser.force_login(placed.user)
    answer = browser.get(f"/jobs/{placed.pk}/log/", {"attempt": 1, "offset": 0}, headers=hx).content.decode()
    # One page (1 MiB), and a poller that asks for the next one at once ("load"), not in 2 s.
    assert answer.count("a") >= chunk and f"offset={1024 * 1024}" in answer and 'hx-trigger="load"' in answer
    answer = browser.get(f"/jobs/{placed.pk}/log/", {"attempt": 1, "offset": 1024 * 1024}, headers=hx).content.decode()
    assert f"offset={2 * chunk}" in answer and 'hx-trigger="every 2s"' in answer


# -- a real agent against the live portal: output the portal once refused ---------------------

@pytest.fixture
def live_agent(live_server, demo, tmp_path, request):
    """An agent (in this process, real PortalClient over HTTP) with the sandbox ``request.param``."""
    from agents.client import PortalClient
    from agents.probe.sim import SimProbe
    from agents.sandbox import make_driver
    from agents.worker import Agent

    name = f"logs-{uuid.uuid4().hex[:8]}"
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name=name)
    kind = request.param
    driver = make_driver(kind, node=name, **({"state_dir": str(tmp_path)} if kind == "process" else {}))
    agent = Agent(name=name, client=PortalClient(live_server.url, secret, retries=0), driver=driver,
                  probe=SimProbe("1xH100-80GB", node_name=name), stop_grace_s=1.0, background=False,
                  scrub_gpus=False)
    try:
        agent.register()
        yield agent
    finally:
        for t in agent.jobs().values():
            driver.stop(t.handle, 0)
            driver.remove(t.handle)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("live_agent", ["process", "docker"], indirect=True)
def test_a_job_printing_nul_and_bad_utf8_ends_at_its_time_limit(live_agent, demo, sent):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "nul", "image": IMAGE, "time_limit": 2,
        "resources": {"gpus": 0, "cpus": 0.5, "memory_mb": 64},
        "command": ["sh", "-c", r"printf 'a\000b\377\376\n'; while :; do printf 'x\000\200'; sleep 0.2; done"]})
    run_pass()
    # The agent registered speaking protocol 1.4: its launches come in one agent.launches message.
    (_, node_name, ([(job_id, attempt, spec)],)), = [s for s in sent if s[0] == "agent.launches"]
    assert node_name == live_agent.name
    assert live_agent.launch(job_id, attempt, spec) == "started"
    deadline = time.monotonic() + 60
    while Job.objects.get(pk=job.pk).state not in ("timeout", "failed", "succeeded", "cancelled"):
        assert time.monotonic() < deadline, f"job still {Job.objects.get(pk=job.pk).state} after 60 s"
        live_agent.supervise_once()
        time.sleep(0.2)
    job.refresh_from_db()
    assert job.state == "timeout" and live_agent.jobs() == {}
    if live_agent.driver.name == "process":
        assert stored(job).startswith(b"a\x00b\xff\xfe\nx\x00\x80")
    else:  # the engine's json-file log keeps NUL but turns invalid UTF-8 into U+FFFD itself
        assert stored(job).startswith("a\x00b\ufffd\ufffd\nx\x00\ufffd".encode())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("live_agent", ["process", "docker"], indirect=True)
def test_a_job_printing_past_the_cap_is_stored_capped_and_the_agent_stops_reading(live_agent, demo, sent,
                                                                                   settings, monkeypatch):
    settings.JOB_LOG_MAX_BYTES = 64 * 1024
    read = []
    real_read = live_agent.driver.read_logs
    monkeypatch.setattr(live_agent.driver, "read_logs", lambda h, offset: read.append(real_read(h, offset)) or read[-1])
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "chatty", "image": IMAGE, "resources": {"gpus": 0, "cpus": 0.5, "memory_mb": 128},
        "command": ["sh", "-c", "i=0; while [ $i -lt 40 ]; do head -c 100000 /dev/zero | tr '\\0' y; i=$((i+1)); done"]})
    run_pass()
    (_, _, ([(job_id, attempt, spec)],)), = [s for s in sent if s[0] == "agent.launches"]
    live_agent.launch(job_id, attempt, spec)
    deadline = time.monotonic() + 90
    while Job.objects.get(pk=job.pk).state not in ("succeeded", "failed", "timeout", "cancelled"):
        assert time.monotonic() < deadline, "the job did not end"
        live_agent.supervise_once()
        time.sleep(0.1)
    job.refresh_from_db()
    log = stored(job)
    assert job.state == "succeeded" and len(log) <= 64 * 1024 and log.endswith(log_notice(64 * 1024))
    assert log.startswith(b"y" * 1000)
    # 4 MB printed; once the portal said full, the agent read no more of it.
    assert sum(len(r) for r in read) < 4_000_000 - 1_000_000
