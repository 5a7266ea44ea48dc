import base64
import socket

import pytest

from agents.client import PortalClient, PortalError, PortalUnreachable, StaleAttempt
from tests.agents.portal_stub import TOKEN, PortalStub


@pytest.fixture
def stub():
    s = PortalStub()
    yield s
    s.close()


def client(url, **kw):
    kw.setdefault("sleep", lambda s: None)
    return PortalClient(url, TOKEN, timeout_s=5, **kw)


def test_calls_use_the_node_token_and_json(stub):
    c = client(stub.url)
    assert c.last_contact is None
    resp = c.register(name="n1", cpus=8, memory_mb=1000, sandbox="docker",
                      gpus=[{"index": 0, "uuid": "GPU-x", "model": "m", "memory_mb": 1, "pci_bus_id": "b"}])
    assert resp == {"node": 1, "heartbeat_interval_s": 1, "lease_s": 30}
    path, body, headers = stub.requests[0]
    assert path == "/api/agent/v1/register" and body["gpus"][0]["uuid"] == "GPU-x"
    assert headers["Authorization"] == f"Bearer {TOKEN}" and headers["Content-Type"] == "application/json"
    assert c.last_contact is not None


def test_every_endpoint_and_body(stub):
    stub.spec = {"image": "i"}
    c = client(stub.url)
    assert c.heartbeat(samples=[{"gpu_uuid": "GPU-x"}], jobs=[{"job_id": "1", "attempt": 1, "state": "running"}]) \
        == {"drain": False, "stop": []}
    assert c.confirm("job/1", 2) == {"image": "i"}
    c.event("job/1", 2, "failed", exit_code=3, message="boom")
    c.logs("job/1", 2, 10, b"ok \xff\n")
    paths = [p for p, _, _ in stub.requests]
    assert paths == ["/api/agent/v1/heartbeat", "/api/agent/v1/jobs/job%2F1/confirm",
                     "/api/agent/v1/jobs/job%2F1/events", "/api/agent/v1/jobs/job%2F1/logs"]
    assert stub.requests[2][1] == {"attempt": 2, "state": "failed", "exit_code": 3, "message": "boom"}
    # Raw bytes, base64: a job may print NUL and invalid UTF-8.
    assert stub.requests[3][1] == {"attempt": 2, "offset": 10, "data_base64": base64.b64encode(b"ok \xff\n").decode()}
    # Report texts stay within the portal's field limits (a refused report would leave the job running).
    c.event("1", 1, "failed", message="m" * 5000, node_problem="p" * 900)
    assert len(stub.requests[-1][1]["message"]) == 2000 and len(stub.requests[-1][1]["node_problem"]) == 500
    with pytest.raises(ValueError):
        c.event("1", 1, "exploded")
    # Scrub failures ride on the report, in the shape the portal's EventSerializer takes.
    c.event("1", 1, "succeeded", exit_code=0, scrub_failures=[{"gpu_index": 3, "message": "ECC"}])
    assert stub.requests[-1][1] == {"attempt": 1, "state": "succeeded", "exit_code": 0, "message": "",
                                    "scrub_failures": [{"gpu_index": 3, "message": "ECC"}]}


def test_409_is_a_stale_attempt_and_counts_as_contact(stub):
    stub.stale.add(("7", 1))
    c = client(stub.url)
    with pytest.raises(StaleAttempt):
        c.confirm("7", 1)
    assert c.last_contact is not None and len(stub.requests) == 1  # not retried


def test_5xx_is_retried_with_backoff(stub):
    sleeps = []
    stub.fail_next = [503, 502]
    c = client(stub.url, sleep=sleeps.append, backoff_s=0.5)
    c.event("1", 1, "running")
    assert len(stub.requests) == 3 and sleeps == [0.5, 1.0]


def test_persistent_5xx_is_unreachable_and_no_contact(stub):
    stub.fail_next = [503] * 10
    c = client(stub.url, retries=2)
    with pytest.raises(PortalUnreachable):
        c.heartbeat(samples=[], jobs=[])
    assert c.last_contact is None and len(stub.requests) == 3


def test_connection_refused_is_retried_then_unreachable():
    sleeps = []
    stub = PortalStub()
    url = stub.url
    stub.close()  # nothing listens there now
    c = client(url, retries=3, sleep=sleeps.append, backoff_s=1, max_backoff_s=3)
    with pytest.raises(PortalUnreachable, match="4 tries"):
        c.heartbeat(samples=[], jobs=[])
    assert sleeps == [1, 2, 3]


def test_auth_failure_is_not_retried(stub):
    c = PortalClient(stub.url, "gpn_wrong", sleep=lambda s: None)
    with pytest.raises(PortalError) as e:
        c.heartbeat(samples=[], jobs=[])
    assert e.value.status == 401 and "bad token" in str(e.value) and len(stub.requests) == 1
    with pytest.raises(ValueError):
        PortalClient(stub.url, "gpp_user_token")


def test_only_heartbeats_and_registration_renew_the_lease(stub):
    now = [100.0]
    c = client(stub.url, clock=lambda: now[0])
    c.event("1", 1, "running")
    c.logs("1", 1, 0, b"x")
    assert c.last_contact == 100.0 and c.lease_renewed_at is None  # the reaper counts heartbeats only
    now[0] = 105.0
    c.heartbeat(samples=[], jobs=[])
    assert c.lease_renewed_at == 105.0


def test_the_portals_outage_answer_renews_the_lease_a_node_proxys_5xx_does_not(stub, monkeypatch):
    now = [100.0]
    off = client(stub.url, clock=lambda: now[0], retries=0, slow_is_outage=False)
    stub.fail_next = [502]  # slow_is_outage off: a 5xx without the outage header is silence
    with pytest.raises(PortalUnreachable):
        off.heartbeat(samples=[], jobs=[])
    assert off.lease_renewed_at is None
    monkeypatch.setenv("HTTP_PROXY", stub.url)  # the node's own proxy (here the stub plays it) may stand
    monkeypatch.delenv("NO_PROXY", raising=False)  # on the node's side of a partition: its 502 is silence
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = client(stub.url, clock=lambda: now[0], retries=0)
    stub.fail_next = [502]
    with pytest.raises(PortalUnreachable):
        proxied.heartbeat(samples=[], jobs=[])
    assert proxied.lease_renewed_at is None and not proxied.slow_is_outage
    monkeypatch.delenv("HTTP_PROXY")
    c = client(stub.url, clock=lambda: now[0], retries=0)
    for code in (502, 503, 504):  # on a direct connection: the portal's proxy has no portal behind it in time
        now[0] += 1
        stub.fail_next = [code]
        with pytest.raises(PortalUnreachable, match=f"web \\(HTTP {code}\\) outage"):
            c.heartbeat(samples=[], jobs=[])
        assert c.lease_renewed_at == now[0] and c.portal_outage == f"web (HTTP {code})"
    stub.fail_next = [500]  # the portal's own error, not its absence: silence
    now[0] += 1
    with pytest.raises(PortalUnreachable):
        c.heartbeat(samples=[], jobs=[])
    assert c.lease_renewed_at == now[0] - 1
    stub.outage = True  # the portal answers, its database is out: it cannot reap us either
    now[0] = 130.0
    with pytest.raises(PortalUnreachable, match="database outage"):
        c.heartbeat(samples=[], jobs=[])
    assert c.lease_renewed_at == 130.0 and c.portal_outage == "database" and c.last_contact is None


def test_a_refused_connection_is_the_portals_web_outage_a_timeout_is_silence(stub):
    """Nothing listening on the portal's port (its web processes restarting) reaches every node alike,
    so it renews the lease like the outage answer; a connection that never answers does not by itself
    (the lease check's renew_if_slow decides), nor a refusal with refused_is_outage off."""
    now = [100.0]
    c = client(stub.url, clock=lambda: now[0], retries=0)
    off = client(stub.url, clock=lambda: now[0], retries=0, refused_is_outage=False)
    stub.stop_listening()
    with pytest.raises(PortalUnreachable, match="connection refused"):
        c.heartbeat(samples=[], jobs=[])
    assert c.lease_renewed_at == 100.0 and c.portal_outage.startswith("web") and c.last_contact is None
    with pytest.raises(PortalUnreachable):
        off.heartbeat(samples=[], jobs=[])
    assert off.lease_renewed_at is None and off.portal_outage == ""
    with socket.socket() as mute:  # accepts connections (the kernel does), never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        slow = PortalClient(f"http://127.0.0.1:{mute.getsockname()[1]}", TOKEN, timeout_s=0.3, retries=0,
                            sleep=lambda s: None)
        with pytest.raises(PortalUnreachable, match="Timeout"):
            slow.heartbeat(samples=[], jobs=[])
        assert slow.lease_renewed_at is None and slow.portal_outage == ""
    stub.listen()  # back on the same port
    now[0] = 110.0
    c.heartbeat(samples=[], jobs=[])
    assert c.lease_renewed_at == 110.0 and c.portal_outage == ""


def test_an_unanswered_request_renews_the_lease_only_while_the_portals_host_accepts_connections():
    """A frozen or overloaded portal: its kernel accepts connections, nothing answers. The lease check asks
    renew_if_slow before fencing: a fresh connection accepted renews the lease from the probe; once the host
    accepts none (gone, or cut off: the connect fails), or with slow_is_outage off, it does not."""
    now = [100.0]
    with socket.socket() as mute:  # accepts connections (the kernel does), never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        slow = PortalClient(url, TOKEN, timeout_s=0.3, retries=0, sleep=lambda s: None, clock=lambda: now[0])
        off = PortalClient(url, TOKEN, timeout_s=0.3, retries=0, sleep=lambda s: None, clock=lambda: now[0],
                           slow_is_outage=False)
        assert not slow.renew_if_slow()  # nothing waited for an answer yet: nothing to renew on
        for c in (slow, off):
            with pytest.raises(PortalUnreachable, match="ReadTimeout"):
                c.heartbeat(samples=[], jobs=[])
        now[0] = 105.0
        assert slow.renew_if_slow() and slow.lease_renewed_at == 105.0 and slow.portal_outage.startswith("web (slow")
        assert not off.renew_if_slow() and off.lease_renewed_at is None
    now[0] = 110.0  # the host no longer accepts connections (here: refused; a partition: the connect times out)
    assert not slow.renew_if_slow(probe_timeout_s=0.5) and slow.lease_renewed_at == 105.0


def test_the_environment_is_read_once_and_netrc_never(stub, monkeypatch, tmp_path):
    """The proxy for the portal comes from the environment the agent started with (read once, not at
    every call), and a ~/.netrc entry for the portal's host does not replace the node token."""
    proxy = PortalStub()
    try:
        host = stub.url.split("//", 1)[1].split(":", 1)[0]
        netrc = tmp_path / "netrc"
        netrc.write_text(f"machine {host} login someone password secret\n")
        monkeypatch.setenv("NETRC", str(netrc))
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        c = client(stub.url)
        monkeypatch.delenv("HTTP_PROXY")
        with pytest.raises(PortalError, match="404"):  # the stub playing the proxy knows no absolute URLs
            c.heartbeat(samples=[], jobs=[])
        assert stub.requests == [] and len(proxy.requests) == 1  # still through the proxy it started with
        path, _, headers = proxy.requests[0]
        assert path == f"{stub.url}/api/agent/v1/heartbeat" and headers["Authorization"] == f"Bearer {TOKEN}"
        direct = client(stub.url)  # started without a proxy: straight to the portal, token intact
        direct.heartbeat(samples=[], jobs=[])
        assert [p for p, _, _ in stub.requests] == ["/api/agent/v1/heartbeat"]
        assert stub.requests[0][2]["Authorization"] == f"Bearer {TOKEN}"
    finally:
        proxy.close()
