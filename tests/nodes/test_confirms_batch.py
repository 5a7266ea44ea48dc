"""Protocol 1.7's batched confirmations (POST /api/agent/v1/confirms): a node's launches of one pass
confirmed in one request, each as its single confirm would be (the job turns starting, its launch
spec in the answer), a stale one answered "stale" without undoing the others; and the agent's side,
its launches confirming together in one request against the live portal."""
import threading

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from agents import protocol
from portal.core.context import Actor
from portal.jobs.models import Job, JobEvent
from portal.jobs.services import job_submit
from scheduler.adapter import run_pass
from tests.conftest import agent_client
from tests.nodes.test_events_batch import post, registered_with_jobs
from tests.procs import wait_for


def submit(demo, n, name="c"):
    return [job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": f"{name}{i}", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})[0] for i in range(n)]


@pytest.fixture
def assigned(demo, monkeypatch):
    """Node gpu-01's agent client and three 1-GPU jobs assigned to it, not yet confirmed."""
    node, node.jobs = registered_with_jobs(demo, monkeypatch, 3, "c")
    assert run_pass()["started"] == 3
    return node


def test_a_batch_confirms_each_launch_with_its_spec_and_a_retry_confirms_again(assigned):
    a, b, c = assigned.jobs
    body = {"confirms": [{"job_id": str(c.pk), "attempt": 1}, {"job_id": str(a.pk), "attempt": 1},
                         {"job_id": str(b.pk), "attempt": 2}]}  # b: a stale attempt
    r = post(assigned, "confirms", body)
    assert r.status_code == 200, r.content
    results = r.json()["results"]
    assert [(x["job_id"], x["result"]) for x in results] == [(str(c.pk), "confirmed"), (str(a.pk), "confirmed"),
                                                             (str(b.pk), "stale")]
    assert "attempt 1, not 2" in results[2]["detail"] and "spec" not in results[2]
    # Each spec is the one a single confirm answers: the job's own command, GPUs and attempt.
    for job, result in ((c, results[0]), (a, results[1])):
        single = post(assigned, f"jobs/{job.pk}/confirm", {"attempt": 1}).json()["spec"]
        assert result["spec"] == single and result["spec"]["attempt"] == 1 and result["spec"]["command"] == ["true"]
    states = dict(Job.objects.filter(pk__in=[a.pk, b.pk, c.pk]).values_list("pk", "state"))
    assert states == {a.pk: "starting", b.pk: "assigned", c.pk: "starting"}

    again = post(assigned, "confirms", body)  # the agent did not hear the answer and asks again
    assert [x["result"] for x in again.json()["results"]] == ["confirmed", "confirmed", "stale"]
    assert JobEvent.objects.filter(job_id__in=[a.pk, c.pk], state="starting").count() == 2


def test_a_batchs_confirmations_turn_their_jobs_starting_in_one_statement(assigned):
    """However many launches a batch confirms, one statement moves them and writes their events; a job
    cancelled meanwhile is not moved (nor given a starting event)."""
    a, b, c = assigned.jobs
    Job.objects.filter(pk=b.pk).update(state="cancelled")
    with CaptureQueriesContext(connection) as queries:
        r = post(assigned, "confirms", {"confirms": [{"job_id": str(j.pk), "attempt": 1} for j in (a, b, c)]})
    assert [x["result"] for x in r.json()["results"]] == ["confirmed", "stale", "confirmed"]
    assert sum("UPDATE" in q["sql"] and "jobs_job" in q["sql"] for q in queries.captured_queries) == 1
    assert dict(Job.objects.filter(pk__in=[a.pk, b.pk, c.pk]).values_list("pk", "state")) == {
        a.pk: "starting", b.pk: "cancelled", c.pk: "starting"}
    assert sorted(JobEvent.objects.filter(state="starting").values_list("job_id", "message")) == [
        (a.pk, "Confirmed by gpu-01"), (c.pk, "Confirmed by gpu-01")]


def test_a_batch_says_stale_for_another_nodes_an_unknown_or_an_ended_job(assigned, demo):
    a, b, _ = assigned.jobs
    Job.objects.filter(pk=b.pk).update(state="cancelled")
    other = agent_client(demo, name="gpu-02")
    r = post(other, "confirms", {"confirms": [{"job_id": str(a.pk), "attempt": 1},
                                              {"job_id": "999999", "attempt": 1},
                                              {"job_id": "not-a-job", "attempt": 1}]})
    assert r.status_code == 200, r.content
    assert [x["result"] for x in r.json()["results"]] == ["stale", "stale", "stale"]
    r = post(assigned, "confirms", {"confirms": [{"job_id": str(b.pk), "attempt": 1}]})
    assert r.json()["results"][0]["result"] == "stale"
    assert Job.objects.get(pk=a.pk).state == "assigned"


@pytest.mark.parametrize("body", [
    {"confirms": []},
    {},
    {"confirms": [{"attempt": 1}]},  # no job_id
    {"confirms": [{"job_id": "1"}]},  # no attempt
    {"confirms": [{"job_id": "1", "attempt": -1}]},
    {"confirms": [{"job_id": "1", "attempt": 1, "colour": "red"}]},
    {"confirms": [{"job_id": "1", "attempt": 1}] * (protocol.EVENTS_MAX + 1)},
])
def test_a_bad_batch_is_a_400_naming_the_field_and_confirms_nothing(assigned, body):
    r = post(assigned, "confirms", body)
    assert r.status_code == 400, r.content
    assert "confirms" in str(r.json()["error"]["fields"])
    assert set(Job.objects.filter(pk__in=[j.pk for j in assigned.jobs]).values_list("state", flat=True)) == {
        "assigned"}


def test_a_batch_needs_a_node_token(assigned, client):
    assert client.post("/api/agent/v1/confirms", {"confirms": []}, content_type="application/json").status_code == 401


@pytest.fixture
def live_agent(live_server, demo, monkeypatch, tmp_path):
    """A real Agent registered with the live portal through PortalClient (the requests it sends are
    listed in ``agent.sent``), and four jobs submitted: the first two placed on its node, the other
    two not (as if the portal had moved on: their confirmations are stale)."""
    from agents.client import PortalClient
    from agents.probe.sim import SimProbe
    from agents.sandbox.process_driver import ProcessDriver
    from agents.worker import Agent
    from portal.nodes.services import node_add

    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    monkeypatch.setattr("portal.core.queue._publish_schedule_pass", lambda: None)
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-live")
    client = PortalClient(live_server.url, secret, retries=0)
    agent = Agent(name="gpu-live", client=client, driver=ProcessDriver(node="gpu-live", state_dir=str(tmp_path)),
                  probe=SimProbe("4xH100-80GB", node_name="gpu-live"), background=False)
    agent.register()
    assert agent.batch_confirms
    submitted = submit(demo, 4, name="live")
    assert run_pass()["started"] == 2  # the demo's per-user limit: the other two wait in the queue
    placed = set(Job.objects.filter(state="assigned").values_list("pk", flat=True))
    agent.jobs_ = sorted(submitted, key=lambda j: j.pk not in placed)
    assert {j.pk for j in agent.jobs_[:2]} == placed
    agent.sent = []
    real_post = client._post
    monkeypatch.setattr(client, "_post", lambda path, body: agent.sent.append(path) or real_post(path, body))
    yield agent
    client.session.close()  # its kept-alive connection holds a live-server thread and its database connection


def confirm_in_threads(agent, jobs) -> tuple[dict, list[threading.Thread]]:
    from agents.client import StaleAttempt

    out = {}

    def launch(job):
        try:
            out[job.pk] = agent._confirm(str(job.pk), 1)
        except StaleAttempt as exc:
            out[job.pk] = exc

    threads = [threading.Thread(target=launch, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    return out, threads


def assert_confirmed(out, jobs):
    from agents.client import StaleAttempt

    for job in jobs[:2]:
        assert out[job.pk]["job_id"] == str(job.pk) and out[job.pk]["attempt"] == 1
    assert all(isinstance(out[job.pk], StaleAttempt) for job in jobs[2:])
    assert list(Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("state").values_list("state", flat=True)) \
        == ["queued", "queued", "starting", "starting"]


@pytest.mark.django_db(transaction=True)
def test_an_agents_launches_confirming_meanwhile_go_up_together_to_the_live_portal(live_agent, monkeypatch):
    """Agent._confirm through PortalClient.confirm_batch against the real agent API: launches that
    confirm while another confirmation is in flight go up together, each gets its own spec, and a
    stale one raises StaleAttempt in its own launch only."""
    jobs, client = live_agent.jobs_, live_agent.client
    # The first confirmation is held in flight until the other three have queued behind it.
    first_sent, release = threading.Event(), threading.Event()
    real_confirm = client.confirm

    def held_confirm(job_id, attempt):
        first_sent.set()
        assert release.wait(10)
        return real_confirm(job_id, attempt)

    monkeypatch.setattr(client, "confirm", held_confirm)
    out, threads = confirm_in_threads(live_agent, jobs[:1])
    assert first_sent.wait(10)
    more, later = confirm_in_threads(live_agent, jobs[1:])
    wait_for(lambda: len(live_agent._confirms._queue) == 3, 10, "three confirmations queued behind the first")
    release.set()
    for t in threads + later:
        t.join(10)
    assert live_agent.sent == [f"/jobs/{jobs[0].pk}/confirm", "/confirms"]
    assert_confirmed(out | more, jobs)


@pytest.mark.django_db(transaction=True)
def test_a_nodes_launches_of_one_pass_confirm_in_one_request_to_the_live_portal(live_agent):
    """agent.launches announces its launches (Agent.expect_launches): all four go in one request."""
    live_agent.expect_launches(4)
    out, threads = confirm_in_threads(live_agent, live_agent.jobs_)
    for t in threads:
        t.join(10)
    assert live_agent.sent == ["/confirms"]
    assert_confirmed(out, live_agent.jobs_)
