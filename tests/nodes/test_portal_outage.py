"""The portal's own outages are not node failures: a cache outage never fails a heartbeat, a
database outage answers 503 + Retry-After, and the reaper gives every node a fresh lease after
an outage of its own before it marks anyone down."""
import socket
import subprocess
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.nodes.models import Node, ReaperState
from portal.jobs.node_effects import nodes_reap
from portal.nodes.services import node_add
from tests.conftest import agent_client, make_token
from tests.procs import wait_for

SAMPLE = {"gpu_uuid": "GPU-o-0", "gpu_index": 0, "utilization": 50.0, "memory_used_mb": 100, "temperature_c": 40,
          "power_w": 100.0, "ecc_errors": 0, "xid_errors": []}
INVENTORY = [{"index": 0, "uuid": "GPU-o-0", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent(demo):
    client = agent_client(demo, "out-01", "1xH100-80GB")
    r = client.post("/api/agent/v1/register", {"name": "out-01", "cpus": 4, "memory_mb": 16384, "sandbox": "docker",
                                                "gpus": INVENTORY}, format="json")
    assert r.status_code == 200
    return client


def heartbeat(client):
    return client.post("/api/agent/v1/heartbeat", {"samples": [SAMPLE], "jobs": []}, format="json")


class PrivateRedis:
    """A redis-server of the test's own on a free port: stopped and started at will."""

    def __init__(self, tmp_path):
        self.port, self.dir, self.proc = free_port(), tmp_path, None

    def start(self):
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait(10)


@pytest.fixture
def private_redis(tmp_path, settings, monkeypatch):
    server = PrivateRedis(tmp_path)
    monkeypatch.setattr("portal.core.cache.RETRY_AFTER_S", 0.2)
    settings.CACHES = {"default": {"BACKEND": "portal.core.cache.ResilientRedisCache",
                                   "LOCATION": f"redis://127.0.0.1:{server.port}/0",
                                   "OPTIONS": {"socket_connect_timeout": 1.0, "socket_timeout": 1.0}}}
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_a_cache_outage_never_fails_a_heartbeat_or_a_request(agent, private_redis, demo):
    from django.core.cache import cache

    assert heartbeat(agent).status_code == 200
    assert cache.get("gpu-sample:GPU-o-0")["utilization"] == 50.0  # the live tiles' sample is in Redis
    private_redis.stop()
    before = Node.objects.get(name="out-01").last_heartbeat_at
    for _ in range(3):
        r = heartbeat(agent)
        assert r.status_code == 200 and r.json()["stop"] == []
    assert Node.objects.get(name="out-01").last_heartbeat_at > before
    # Throttle counters live in the cache too: the user API keeps answering.
    user = APIClient()
    user.credentials(HTTP_AUTHORIZATION=f"Bearer {make_token(demo.users['alice'])}")
    assert user.get("/api/v1/jobs/").status_code == 200
    private_redis.start()  # back, empty: the next heartbeat fills it again
    deadline = time.monotonic() + 10
    while cache.get("gpu-sample:GPU-o-0") is None:
        assert time.monotonic() < deadline, "the cache was not used again after Redis came back"
        assert heartbeat(agent).status_code == 200
        time.sleep(0.1)


@pytest.fixture
def database_out():
    """Point the connection at a port nothing listens on (the database is unreachable), and back."""
    saved = dict(connection.settings_dict)

    def cut():
        connection.close()
        connection.settings_dict.update(HOST="127.0.0.1", PORT=str(free_port()))

    try:
        yield cut
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


@pytest.mark.django_db(transaction=True)
def test_with_the_database_out_the_apis_answer_503_with_retry_after(agent, demo, database_out):
    user = APIClient()
    user.credentials(HTTP_AUTHORIZATION=f"Bearer {make_token(demo.users['alice'])}")
    page = APIClient()
    page.force_login(demo.users["alice"])
    database_out()
    for r in (heartbeat(agent), user.get("/api/v1/jobs/"),
              user.post("/api/v1/jobs/", {"project": "vision", "image": "x", "command": ["true"]}, format="json")):
        assert r.status_code == 503, r.content
        assert r["Retry-After"] == "5" and r["X-Gpuportal-Outage"] == "database"
        assert r.json()["error"]["code"] == "database_unavailable"
    r = page.get("/")
    assert r.status_code == 503 and b"cannot reach its database" in r.content


def test_a_bad_query_is_still_a_500(agent, monkeypatch):
    """Only connection-level errors are an outage; a bug must not hide behind a 503."""
    from django.db import ProgrammingError

    def broken(**kw):
        raise ProgrammingError("relation does not exist")

    monkeypatch.setattr("portal.agentapi.heartbeat.agent_heartbeat", broken)
    agent.raise_request_exception = False
    assert heartbeat(agent).status_code == 500


def silence(node_names, seconds):
    Node.objects.filter(name__in=node_names).update(last_heartbeat_at=timezone.now() - timedelta(seconds=seconds))


def test_after_its_own_outage_the_reaper_gives_every_node_a_fresh_lease(agent, settings):
    nodes_reap()  # the reaper ran...
    # ...then the portal was out for a minute (database, broker or workers): it heard no heartbeat.
    ReaperState.objects.filter(pk=1).update(last_run_at=timezone.now() - timedelta(seconds=60))
    silence(["out-01"], settings.NODE_TIMEOUT_S + 30)
    result = nodes_reap()
    assert result["down"] == 0 and "fresh_lease_until" in result
    assert Node.objects.get(name="out-01").state == "ready"
    # The fresh lease is the ordinary one: still silent once it has passed, the node goes down.
    ReaperState.objects.filter(pk=1).update(leases_fresh_since=timezone.now() - timedelta(
        seconds=settings.NODE_TIMEOUT_S + 1))
    assert nodes_reap()["down"] == 1
    assert Node.objects.get(name="out-01").state == "down"


def test_nodes_back_after_a_mass_silence_are_not_reaped_for_the_portals_fault(demo, settings):
    admin = Actor(user=demo.users["admin"])
    names = [f"m{i}" for i in range(4)]
    for name in names:
        node_add(actor=admin, name=name, gpus="1xH100-80GB")
    nodes_reap()
    silence(names, settings.NODE_TIMEOUT_S + 5)
    assert nodes_reap()["suspected_portal_failure"] == 4
    silence(names[:3], 0)  # three are back; the fourth has not heartbeated yet
    assert nodes_reap()["down"] == 0
    assert not Node.objects.filter(state="down").exists()


@pytest.mark.django_db(transaction=True)
def test_a_database_restart_costs_no_failed_request(agent):
    """The persistent connection dies with the server's restart (here: its backend is ended); the
    next request's first query notices and reconnects instead of answering 503 or 500."""
    import psycopg

    assert heartbeat(agent).status_code == 200
    pid = connection.connection.info.backend_pid
    db = connection.settings_dict
    with psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"],
                         autocommit=True) as other:
        assert other.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]
        # The call returns as the signal is sent; the backend says goodbye and ends a moment later
        # (a restart's requests come later still: the server is down for seconds).
        gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s"
        wait_for(lambda: other.execute(gone, [pid]).fetchone()[0], 10, "the terminated backend to end")
    # What a WSGI server's request_started does before each request (the test client skips it).
    from django.db import close_old_connections

    close_old_connections()
    assert heartbeat(agent).status_code == 200
    assert connection.connection.info.backend_pid != pid


def test_nodes_lost_a_few_at_a_time_count_towards_a_mass_silence(demo, settings):
    """An overloaded portal loses nodes in batches, each under the threshold: those marked down
    lately count as silent, so the reaper stops before it has marked most of the fleet down."""
    admin = Actor(user=demo.users["admin"])
    names = [f"s{i}" for i in range(10)]
    for name in names:
        node_add(actor=admin, name=name, gpus="1xH100-80GB")
    nodes_reap()
    silence(names, 0)
    silence(names[:4], settings.NODE_TIMEOUT_S + 5)
    assert nodes_reap()["down"] == 4  # 4 of 10: a real failure, as far as anyone can tell
    silence(names[4:6], settings.NODE_TIMEOUT_S + 5)
    result = nodes_reap()  # 2 of the 6 left, but 6 of the 10 within a minute
    assert result["down"] == 0 and result["suspected_portal_failure"] == 6
    assert Node.objects.filter(state="down").count() == 4
