"""Protocol 1.2's batched end reports (POST /api/agent/v1/events): many jobs of one node ending
together in one request, each applied as its single report would be (idempotent, fenced by its
attempt), a stale one answered "stale" without undoing the others."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from agents import protocol
from portal.core.context import Actor
from portal.jobs.models import Allocation, Job, JobEvent
from portal.jobs.services import job_submit
from scheduler.adapter import run_pass
from tests.conftest import agent_client

INVENTORY = [{"index": i, "uuid": f"GPU-batch-{i}", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}
             for i in range(4)]


def post(client, path, body):
    return client.post(f"/api/agent/v1/{path}", data=body, format="json")


def registered_with_jobs(demo, monkeypatch, n: int, name: str = "j"):
    """Node gpu-01's agent client, registered (launches are not sent), and `n` 1-GPU `true` jobs
    alice submitted to vision, not yet scheduled."""
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    node = agent_client(demo)
    assert post(node, "register", {"name": "gpu-01", "cpus": 16, "memory_mb": 65536, "sandbox": "docker",
                                   "gpus": INVENTORY}).status_code == 200
    return node, [job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": f"{name}{i}", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})[0] for i in range(n)]


@pytest.fixture
def running(demo, monkeypatch):
    """Node gpu-01's agent client and three 1-GPU jobs running on it."""
    node, jobs = registered_with_jobs(demo, monkeypatch, 3)
    run_pass()
    for job in jobs:
        assert post(node, f"jobs/{job.pk}/confirm", {"attempt": 1}).status_code == 200
        assert post(node, f"jobs/{job.pk}/events", {"attempt": 1, "state": "running"}).status_code == 200
    node.jobs = jobs
    return node


def test_a_batch_ends_each_job_once_and_a_retry_is_a_duplicate(running):
    a, b, c = running.jobs
    body = {"events": [{"job_id": str(a.pk), "attempt": 1, "state": "succeeded", "exit_code": 0},
                       {"job_id": str(b.pk), "attempt": 1, "state": "failed", "exit_code": 3, "message": "boom"},
                       {"job_id": str(c.pk), "attempt": 2, "state": "succeeded", "exit_code": 0}]}  # stale attempt
    r = post(running, "events", body)
    assert r.status_code == 200, r.content
    results = r.json()["results"]
    assert [(x["job_id"], x["result"]) for x in results] == [(str(a.pk), "applied"), (str(b.pk), "applied"),
                                                             (str(c.pk), "stale")]
    assert "attempt 1, not 2" in results[2]["detail"]
    states = {j.pk: j for j in Job.objects.filter(pk__in=[a.pk, b.pk, c.pk])}
    assert (states[a.pk].state, states[a.pk].exit_code) == ("succeeded", 0)
    assert (states[b.pk].state, states[b.pk].exit_code) == ("failed", 3)
    assert states[c.pk].state == "running"  # the stale report changed nothing
    assert not Allocation.objects.filter(job_id__in=[a.pk, b.pk], released_at__isnull=True).exists()
    assert Allocation.objects.filter(job=c, released_at__isnull=True).count() == 1

    again = post(running, "events", body)  # the agent did not hear the answer and sends it again
    assert [x["result"] for x in again.json()["results"]] == ["duplicate", "duplicate", "stale"]
    assert JobEvent.objects.filter(job_id__in=[a.pk, b.pk], terminal=True).count() == 2


def test_a_batch_says_stale_for_another_nodes_or_an_unknown_job(running, demo):
    other = agent_client(demo, name="gpu-02")
    a = running.jobs[0]
    r = post(other, "events", {"events": [{"job_id": str(a.pk), "attempt": 1, "state": "failed"},
                                          {"job_id": "999999", "attempt": 1, "state": "failed"},
                                          {"job_id": "not-a-job", "attempt": 1, "state": "failed"}]})
    assert r.status_code == 200, r.content
    assert [x["result"] for x in r.json()["results"]] == ["stale", "stale", "stale"]
    assert Job.objects.get(pk=a.pk).state == "running"


@pytest.mark.parametrize("body, field", [
    ({"events": []}, "events"),
    ({}, "events"),
    ({"events": [{"attempt": 1, "state": "failed"}]}, "events"),  # no job_id
    ({"events": [{"job_id": "1", "attempt": 1, "state": "exploded"}]}, "events"),
    ({"events": [{"job_id": "1", "attempt": 1, "state": "failed", "colour": "red"}]}, "events"),
    ({"events": [{"job_id": "1", "attempt": 1, "state": "failed"}] * (protocol.EVENTS_MAX + 1)}, "events"),
])
def test_a_bad_batch_is_a_400_naming_the_field_and_applies_nothing(running, body, field):
    r = post(running, "events", body)
    assert r.status_code == 400, r.content
    assert field in str(r.json()["error"]["fields"])
    assert set(Job.objects.filter(pk__in=[j.pk for j in running.jobs]).values_list("state", flat=True)) == {"running"}


def test_a_batch_needs_a_node_token(running, client):
    assert client.post("/api/agent/v1/events", {"events": []}, content_type="application/json").status_code == 401


@pytest.mark.django_db(transaction=True)
def test_the_agents_client_sends_a_batch_the_live_portal_applies(live_server, demo, monkeypatch):
    """PortalClient.event_batch against the real agent API, no stub in between."""
    from agents.client import PortalClient
    from portal.nodes.services import node_add

    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: None)
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-live")
    client = PortalClient(live_server.url, secret, retries=0)
    assert client.register(name="gpu-live", cpus=8, memory_mb=32768, sandbox="process", gpus=INVENTORY[:2])[
        "protocol_version"] == protocol.PROTOCOL_VERSION
    jobs = [job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": f"j{i}", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})[0] for i in range(2)]
    assert run_pass()["started"] == 2
    for job in jobs:
        client.confirm(str(job.pk), 1)
    results = client.event_batch([{"job_id": job.pk, "attempt": 1, "state": "succeeded", "exit_code": 0,
                                   "message": "x" * (protocol.EVENT_MESSAGE_MAX + 10)} for job in jobs])
    assert [r["result"] for r in results] == ["applied", "applied"]
    assert list(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == ["succeeded"] * 2


def test_a_batch_of_ends_asks_once_for_a_pass_and_mails_whoever_wants_it(running, demo, monkeypatch,
                                                                          django_capture_on_commit_callbacks):
    """What each end asks for is done once for the batch: one pass request, one look at who wants
    mail (alice: failures only, the default), the drained node settled; each wanted mail still goes."""
    from portal.accounts.models import NotificationPreference
    from portal.core.context import Actor
    from portal.jobs.node_effects import node_drain
    from portal.nodes.models import Node

    passes, mails = [], []
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: passes.append(1))
    monkeypatch.setattr("portal.jobs.notifications.send", lambda name, args, queue: mails.append((name, args)))
    NotificationPreference.objects.filter(user=demo.users["alice"]).delete()  # the defaults hold
    node_drain(actor=Actor(user=demo.users["admin"]), node=running.node, reason="maintenance")
    a, b, c = running.jobs
    with django_capture_on_commit_callbacks(execute=True):
        r = post(running, "events", {"events": [
            {"job_id": str(a.pk), "attempt": 1, "state": "succeeded", "exit_code": 0},
            {"job_id": str(b.pk), "attempt": 1, "state": "failed", "exit_code": 3},
            {"job_id": str(c.pk), "attempt": 1, "state": "oom"}]})
    assert [x["result"] for x in r.json()["results"]] == ["applied"] * 3
    assert passes == [1]
    assert sorted(mails) == [("jobs.notify", [b.pk, 1, "failed"]), ("jobs.notify", [c.pk, 1, "failed"])]
    assert Node.objects.get(pk=running.node.pk).state == "drained"  # its last jobs ended in the batch
    # An end whose `running` report never landed still gets a start, in the same UPDATE.
    assert all(j.started_at is not None and j.started_at <= j.ended_at for j in Job.objects.filter(pk__in=[a.pk, b.pk]))


def test_a_batch_rolled_back_by_a_deadlock_mails_and_passes_from_its_one_by_one_retry(
        running, monkeypatch, django_capture_on_commit_callbacks):
    """A batch the database picks as a deadlock's victim is applied again event by event: nothing of
    the lost try is mailed, each retried end is, once."""
    from django.db import OperationalError

    import portal.jobs.reports as reports

    mails = []
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: None)
    monkeypatch.setattr("portal.jobs.notifications.mail_wanted_many",
                        lambda notes: {(job_id, kind) for job_id, _, kind in notes})
    monkeypatch.setattr("portal.jobs.notifications.send", lambda name, args, queue: mails.append(args))
    real, calls = reports._apply, []

    class DeadlockDetected(Exception):
        pass

    def apply_once_then_lose(node, events, indexes, one):
        calls.append(list(indexes))
        results = real(node, events, indexes, one)
        if len(calls) == 1:
            raise OperationalError("deadlock detected") from DeadlockDetected()
        return results

    monkeypatch.setattr(reports, "_apply", apply_once_then_lose)
    a, b, _ = running.jobs
    with django_capture_on_commit_callbacks(execute=True):
        r = post(running, "events", {"events": [{"job_id": str(j.pk), "attempt": 1, "state": "failed"}
                                                for j in (a, b)]})
    assert [x["result"] for x in r.json()["results"]] == ["applied", "applied"]
    assert calls == [[0, 1], [0], [1]]
    assert sorted(mails) == [[a.pk, 1, "failed"], [b.pk, 1, "failed"]]


@pytest.fixture
def confirmed(demo, monkeypatch):
    """Node gpu-01's agent client and a 1-GPU job it has just confirmed (starting)."""
    node, (job,) = registered_with_jobs(demo, monkeypatch, 1, "quick")
    run_pass()
    assert post(node, f"jobs/{job.pk}/confirm", {"attempt": 1}).status_code == 200
    return node, job


def test_a_jobs_running_report_and_its_end_in_one_batch_apply_in_order(confirmed):
    """An agent whose job ended while the launch held its `running` report (agents/worker.py,
    RUNNING_HOLD_S) sends both in one batch: the job runs, then ends, each with its event."""
    node, job = confirmed
    with CaptureQueriesContext(connection) as queries:
        r = post(node, "events", {"events": [
            {"job_id": str(job.pk), "attempt": 1, "state": "running"},
            {"job_id": str(job.pk), "attempt": 1, "state": "succeeded", "exit_code": 0}]})
    assert [x["result"] for x in r.json()["results"]] == ["applied", "applied"]
    # The job is read once, and one statement writes its start, its end and both events.
    assert sum(q["sql"].startswith('SELECT "jobs_job"."id"') for q in queries.captured_queries) == 1
    assert sum(q["sql"].startswith("WITH moved AS (UPDATE") for q in queries.captured_queries) == 1
    job.refresh_from_db()
    assert (job.state, job.exit_code) == ("succeeded", 0) and job.started_at <= job.ended_at
    assert list(JobEvent.objects.filter(job=job).order_by("id").values_list("state", flat=True))[-2:] == [
        "running", "succeeded"]
    assert not Allocation.objects.filter(job=job, released_at__isnull=True).exists()


def test_a_job_cancelled_after_the_batch_read_it_keeps_its_cancel(confirmed, monkeypatch):
    """The user's cancel lands between the batch's read and its write: the running-and-end statement
    moves nothing, and the end, applied on its own, is a duplicate of the job's end, as it would be
    sent apart."""
    from portal.jobs import reports

    node, job = confirmed
    real = reports._prefetch

    def read_then_cancelled(events, indexes):
        read = real(events, indexes)
        Job.objects.filter(pk=job.pk).update(state="cancelled")
        return read

    monkeypatch.setattr(reports, "_prefetch", read_then_cancelled)
    r = post(node, "events", {"events": [{"job_id": str(job.pk), "attempt": 1, "state": "running"},
                                         {"job_id": str(job.pk), "attempt": 1, "state": "succeeded", "exit_code": 0}]})
    assert [x["result"] for x in r.json()["results"]] == ["applied", "duplicate"]
    job.refresh_from_db()
    assert job.state == "cancelled" and job.exit_code is None
    assert not JobEvent.objects.filter(job=job, state__in=["running", "succeeded"]).exists()
