"""Hold, release and update of a queued job (Slurm's scontrol hold/release/update) over the API."""
import pytest

from portal.core.context import Actor
from portal.core.models import AuditEvent
from portal.jobs.models import Job, JobState
from portal.jobs.states import transition
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import submit as submit_job


@pytest.fixture
def cluster(demo, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **kw: None)
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    return demo


def submit(demo, user="bob", project="vision", **over):
    return submit_job(demo, user, project, **over)


def url(job, action=""):
    return f"/api/v1/jobs/{job.pk}/{action + '/' if action else ''}"


def test_held_job_is_never_scheduled_until_released(cluster, api):
    job = submit(cluster, resources={"gpus": 1})
    r = api("bob").post(url(job, "hold"))
    assert r.status_code == 200, r.content
    assert r.json()["held"] is True and r.json()["state"] == "queued"
    assert r.json()["reason"]["code"] == "held" and "bob" in r.json()["reason"]["message"]
    run_pass()
    run_pass()
    job.refresh_from_db()
    assert job.state == "queued" and job.reason_code == "held" and job.queue_position is None
    assert job.node is None

    r = api("bob").post(url(job, "release"))
    assert r.status_code == 200 and r.json()["held"] is False
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned"
    assert list(AuditEvent.objects.filter(object_id=str(job.pk), action__in=["job.hold", "job.release"]).order_by("id")
                .values_list("action", "actor_label")) == [("job.hold", "bob"), ("job.release", "bob")]
    messages = list(job.events.values_list("message", flat=True))
    assert any(m.startswith("Held by bob") for m in messages) and "Released by bob." in messages


def test_hold_of_an_array_holds_its_queued_tasks(cluster, api):
    parent = submit(cluster, array="0-2", resources={"gpus": 1})
    assert api("bob").post(url(parent, "hold")).status_code == 200
    run_pass()
    assert set(parent.tasks.values_list("state", "held", "reason_code")) == {("queued", True, "held")}
    held = api("bob").get("/api/v1/jobs/?held=true").json()
    assert held["count"] == 4 and {j["slurm_id"] for j in held["results"]} == {
        str(parent.pk), f"{parent.pk}_0", f"{parent.pk}_1", f"{parent.pk}_2"}
    r = api("bob").patch(url(parent), {"time_limit": 600}, format="json")
    assert r.status_code == 200 and set(parent.tasks.values_list("time_limit_s", flat=True)) == {600}
    assert api("bob").post(url(parent, "release")).status_code == 200
    run_pass()
    assert set(parent.tasks.values_list("state", flat=True)) == {"assigned"}


def test_only_a_queued_job_can_be_held_or_updated(cluster, api):
    job = submit(cluster, resources={"gpus": 1})
    run_pass()
    for action, method in (("hold", "post"), ("release", "post"), ("", "patch")):
        r = getattr(api("bob"), method)(url(job, action), {"time_limit": 60}, format="json")
        assert r.status_code == 409, (action, r.content)
    fresh = submit(cluster)
    assert api("bob").post(url(fresh, "release")).status_code == 409  # not held


def test_outsider_gets_404_viewer_and_other_members_get_403(cluster, api):
    job = submit(cluster)
    for action, method in (("hold", "post"), ("release", "post"), ("", "patch")):
        r = getattr(api("charlie"), method)(url(job, action), {"priority": "low"}, format="json")
        assert r.status_code == 404, action
        r = getattr(api("dave"), method)(url(job, action), {"priority": "low"}, format="json")
        assert r.status_code == 403, action
    alices = submit(cluster, user="alice")
    assert api("bob").post(url(alices, "hold")).status_code == 403  # a member holds only their own
    assert api("alice").post(url(job, "hold")).status_code == 200  # the owner holds anyone's
    job.refresh_from_db()
    assert job.held


def test_submitter_may_lower_but_not_raise_time_limit_and_priority(cluster, api):
    job = submit(cluster, time_limit=7200, resources={"gpus": 1})
    r = api("bob").patch(url(job), {"time_limit": "30m", "priority": "low", "resources": {"gpus": 2}},
                         format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["time_limit"] == 1800 and body["priority"] == "low" and body["resources"]["gpus"] == 2
    assert AuditEvent.objects.filter(action="job.update", object_id=str(job.pk)).get().data == {
        "time_limit_s": "1800", "priority": "low", "gpus": "2", "gpu_memory_mb": "0"}

    r = api("bob").patch(url(job), {"time_limit": "3h", "priority": "high"}, format="json")
    assert r.status_code == 400
    assert set(r.json()["error"]["fields"]) == {"time_limit", "priority"}
    job.refresh_from_db()
    assert (job.time_limit_s, job.priority) == (1800, "low")  # a refused update changes nothing

    r = api("alice").patch(url(job), {"time_limit": "3h", "priority": "high"}, format="json")
    assert r.status_code == 200 and r.json()["time_limit"] == 10800 and r.json()["priority"] == "high"


def test_update_reports_every_bad_field_at_once(cluster, api):
    job = submit(cluster, resources={"gpus": 1})
    r = api("alice").patch(url(job), {"time_limit": "soon", "priority": "urgent", "resources": {"gpus": "x"}},
                           format="json")
    assert r.status_code == 400
    assert set(r.json()["error"]["fields"]) == {"time_limit", "priority", "resources.gpus"}
    r = api("alice").patch(url(job), {"time_limit": "30d", "resources": {"gpus": 64}}, format="json")
    assert r.status_code == 400
    fields = r.json()["error"]["fields"]
    assert "exceeds the project maximum" in fields["time_limit"][0]
    assert "exceeds the project limit of 16" in fields["resources.gpus"][0]
    r = api("alice").patch(url(job), {"resources": {"gpus": "1.5"}}, format="json")
    assert r.status_code == 400 and "integers" in r.json()["error"]["fields"]["resources.gpus"][0]
    r = api("alice").patch(url(job), {"state": "running"}, format="json")
    assert r.status_code == 400 and "Unknown field" in r.content.decode()
    r = api("alice").patch(url(job), {}, format="json")
    assert r.status_code == 400
    job.refresh_from_db()
    assert job.gpus == 1 and job.time_limit_s == 3600


def test_update_changes_what_the_scheduler_places(cluster, api):
    job = submit(cluster, resources={"gpus": 1})
    assert api("bob").post(url(job, "hold")).status_code == 200
    assert api("bob").patch(url(job), {"resources": {"gpus": 4}}, format="json").status_code == 200
    assert api("bob").post(url(job, "release")).status_code == 200
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned" and job.allocations.count() == 4


def test_a_token_needs_submit_scope(cluster, api):
    from tests.conftest import make_token

    job = submit(cluster)
    read_only = make_token(cluster.users["bob"], scopes=("read",))
    assert api(token=read_only).post(url(job, "hold")).status_code == 403
    job.refresh_from_db()
    assert not job.held


def test_cancel_of_a_held_job_ends_it(cluster, api):
    job = submit(cluster)
    api("bob").post(url(job, "hold"))
    assert api("bob").post(url(job, "cancel")).status_code == 202
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert not transition(job.pk, to=JobState.QUEUED, from_states={JobState.QUEUED})
    assert Job.objects.filter(held=True, state=JobState.QUEUED).count() == 0


def test_bulk_cancel_cancels_what_it_may_and_names_each_refusal(cluster):
    """jobs_cancel (the jobs page's bulk cancel): one refusal (a job that ended, a job of someone
    else that bob may not cancel) stops no other cancel, and each refusal says which job and why."""
    from portal.jobs.services import jobs_cancel

    mine = [submit(cluster, resources={"gpus": 1}) for _ in range(2)]
    ended = submit(cluster, resources={"gpus": 1})
    transition(ended.pk, to=JobState.CANCELLED, from_states={JobState.QUEUED}, message="gone")
    ended.refresh_from_db()
    theirs = submit(cluster, user="alice", resources={"gpus": 1})
    done, refusals = jobs_cancel(actor=Actor(user=cluster.users["bob"]), jobs=[*mine, ended, theirs])
    assert done == [j.pk for j in mine]
    assert set(Job.objects.filter(pk__in=done).values_list("state", flat=True)) == {JobState.CANCELLED}
    assert [r.split(":")[0] for r in refusals] == [f"Job {ended.pk}", f"Job {theirs.pk}"]
    assert "cancelled and cannot be cancelled" in refusals[0]
    assert Job.objects.get(pk=theirs.pk).state == JobState.QUEUED
