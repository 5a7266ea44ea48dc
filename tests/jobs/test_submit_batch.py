"""Batch submit (POST /api/v1/jobs/batch/): many jobs in one request, all or nothing."""
import pytest

from portal.core.models import AuditEvent
from portal.jobs.models import Job, JobState
from portal.tenancy.models import Quota

IMAGE = "gpuportal/busybox:latest"
URL = "/api/v1/jobs/batch/"


@pytest.fixture
def alice(demo, api):
    return api("alice")


def test_a_batch_stores_every_job_in_order(alice, demo):
    body = {"defaults": {"project": "vision", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}},
            "jobs": [{"name": f"sweep-{i}", "env": {"SEED": str(i)}} for i in range(5)] + [
                {"name": "big", "resources": {"gpus": 2}, "priority": "low"}]}
    r = alice.post(URL, body, format="json")
    assert r.status_code == 201, r.content
    ids = r.json()["ids"]
    jobs = {j.pk: j for j in Job.objects.filter(pk__in=ids)}
    assert [jobs[i].name for i in ids] == [f"sweep-{i}" for i in range(5)] + ["big"]
    assert ids == sorted(ids)
    assert [jobs[i].env for i in ids[:5]] == [{"SEED": str(i)} for i in range(5)]
    assert (jobs[ids[-1]].gpus, jobs[ids[-1]].priority, jobs[ids[0]].priority) == (2, "low", "normal")
    assert {j.state for j in jobs.values()} == {JobState.QUEUED} and {j.user for j in jobs.values()} == {
        demo.users["alice"]}
    event = AuditEvent.objects.get(action="job.submit_batch")
    assert event.data == {"jobs": 6, "first": ids[0], "last": ids[-1]}


def test_one_refused_job_refuses_the_batch_naming_it(alice):
    body = {"defaults": {"project": "vision", "image": IMAGE, "command": ["true"]},
            "jobs": [{"name": "ok"}, {"name": "too-big", "resources": {"gpus": 64}}, {"name": "x" * 201},
                     "not an object", {"env": {"CUDA_VISIBLE_DEVICES": "0"}}, {"env": {"OK": 1}}]}
    r = alice.post(URL, body, format="json")
    assert r.status_code == 400
    fields = r.json()["error"]["fields"]
    assert set(fields) == {"jobs[1].resources.gpus", "jobs[2].name", "jobs[3]", "jobs[4].env", "jobs[5].env.OK"}, \
        fields
    assert "exceeds the project limit of 16" in fields["jobs[1].resources.gpus"][0]
    assert "reserved" in fields["jobs[4].env"][0]
    assert not Job.objects.exists()


@pytest.mark.parametrize("body, field", [
    ({}, "jobs"), ({"jobs": []}, "jobs"), ({"jobs": "x"}, "jobs"),
    ({"jobs": [{"name": "a"}], "defaults": []}, "defaults"),
    ({"jobs": [{"project": "nope", "image": IMAGE, "command": ["true"]}]}, "jobs[0].project"),
])
def test_a_malformed_batch_is_a_400_naming_the_field(alice, body, field):
    r = alice.post(URL, body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert not Job.objects.exists()


def test_a_batch_over_the_limit_is_refused(alice, settings):
    settings.JOB_BATCH_MAX_JOBS = 3
    r = alice.post(URL, {"defaults": {"project": "vision", "image": IMAGE, "command": ["true"]},
                         "jobs": [{}] * 4}, format="json")
    assert r.status_code == 400 and "At most 3 jobs" in r.json()["error"]["fields"]["jobs"][0]


def test_arrays_and_dependencies_in_a_batch(alice):
    first = alice.post("/api/v1/jobs/", {"project": "vision", "image": IMAGE, "command": ["true"]},
                       format="json").json()["id"]
    r = alice.post(URL, {"defaults": {"project": "vision", "image": IMAGE, "command": ["true"]},
                         "jobs": [{"name": "after", "depends_on": [first]}, {"name": "sweep", "array": "0-3"}]},
                   format="json")
    assert r.status_code == 201, r.content
    after, sweep = (Job.objects.get(pk=i) for i in r.json()["ids"])
    assert list(after.depends_on.values_list("pk", flat=True)) == [first]
    assert sweep.is_array_parent and sweep.tasks.count() == 4


def test_a_spent_budget_refuses_the_batch(alice, demo):
    Quota.objects.filter(project=demo.vision).update(gpu_hours_budget=0)
    r = alice.post(URL, {"defaults": {"project": "vision", "image": IMAGE, "command": ["true"]},
                         "jobs": [{"resources": {"gpus": 1}}]}, format="json")
    assert r.status_code == 409 and r.json()["error"]["code"] == "budget_exhausted"
    assert not Job.objects.exists()


def test_outsiders_and_viewers_cannot_batch_submit(demo, api):
    body = {"defaults": {"project": "vision", "image": IMAGE, "command": ["true"]}, "jobs": [{}]}
    r = api("charlie").post(URL, body, format="json")  # an outsider: no such project, for them
    assert r.status_code == 400 and "jobs[0].project" in r.json()["error"]["fields"]
    assert api("dave").post(URL, body, format="json").status_code == 403  # a viewer
    assert not Job.objects.exists()
