"""The whole path of a database outage: the real portal (its middleware answers 503 with the
outage header), the real agent client and a process-sandbox job that must outlive it."""
import socket
import time

import pytest
from django.db import connection

from agents.client import PortalClient
from agents.sandbox import RUNNING
from agents.sandbox.process_driver import ProcessDriver
from portal.core.context import Actor
from portal.jobs.models import Job
from portal.jobs.services import job_submit
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.agents.conftest import running_agent
from tests.procs import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
# Long enough that a request slowed by a loaded machine (the suite runs on several workers) is not
# taken for silence once the database is back; the outage still lasts three leases.
LEASE_S = 5.0


@pytest.fixture
def live_agent(live_server, demo, tmp_path, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)  # the test launches by hand
    _, token = node_add(actor=Actor(user=demo.users["admin"]), name="live-01")
    driver = ProcessDriver(node="live-01", state_dir=str(tmp_path))
    client = PortalClient(live_server.url, token, timeout_s=5, retries=0)
    # One connection per request: the live server's request thread holds a database connection
    # for as long as its HTTP connection lives, and the test database must be free at the end.
    client.session.headers["Connection"] = "close"
    try:
        with running_agent("live-01", client, driver, lease_s=LEASE_S) as agent:
            yield agent
    finally:
        # The live server closes a request's connection just after answering it: let the last one go
        # before the test database is flushed and dropped.
        wait_for(lambda: not other_sessions(), 10, "the live server's last request to end")


def other_sessions() -> int:
    with connection.cursor() as c:
        c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                  "AND pid <> pg_backend_pid()")
        return c.fetchone()[0]


def cut_database():
    """Every server connection to the test database ends and no new one can be made: the web
    tier's connections die with it, as in a PostgreSQL outage. Returns how to bring it back."""
    import psycopg

    saved = dict(connection.settings_dict)
    db = saved
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    connection.settings_dict.update(PORT=str(closed_port))  # shared with the live server's thread
    with psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname="postgres",
                         autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                      "AND pid <> pg_backend_pid()", [db["NAME"]])
    connection.close()

    def restore():
        connection.close()
        connection.settings_dict.update(PORT=saved["PORT"])

    return restore


def test_a_running_job_outlives_a_database_outage_longer_than_the_lease(live_agent, demo):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "long", "image": "gpuportal/busybox:latest", "command": ["sleep", "120"],
        "resources": {"gpus": 0, "cpus": 0.5, "memory_mb": 64}})
    run_pass()
    assert Job.objects.get(pk=job.pk).node.name == "live-01"
    assert live_agent.launch(str(job.pk), 1, {}) == "started"
    assert Job.objects.get(pk=job.pk).state == "running"

    def sandbox_running():
        return any(live_agent.driver.poll(h)[0] == RUNNING for _, _, h in live_agent.driver.list_own())

    restore = cut_database()
    try:
        wait_for(lambda: live_agent.client.portal_outage == "database", 10, "the portal's outage answer")
        t_end = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < t_end:  # three leases without a database: the job runs on
            assert sandbox_running() and not live_agent.fenced
            time.sleep(0.1)
    finally:
        restore()
    wait_for(lambda: live_agent.client.portal_outage == "", 15, "the portal to answer again")
    assert sandbox_running() and Job.objects.get(pk=job.pk).state == "running"

