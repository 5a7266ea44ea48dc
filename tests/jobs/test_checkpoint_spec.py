"""The job spec's `checkpoint` ({signal, grace_s}): stored and shown as given, every bad value a 400
naming its field, and a resubmit keeps it."""
import pytest

from portal.jobs.models import Job

IMAGE = "gpuportal/busybox:latest"


def submit(client, time_limit=3600, **extra):
    return client.post("/api/v1/jobs/", data={"project": "vision", "image": IMAGE, "command": ["true"],
                                               "time_limit": time_limit, **extra}, format="json")


@pytest.fixture
def alice(demo, api):
    return api("alice")


@pytest.mark.parametrize("given,stored", [
    ({"signal": "SIGUSR2", "grace_s": 300}, {"signal": "SIGUSR2", "grace_s": 300}),
    ({"grace_s": 60}, {"signal": "SIGUSR1", "grace_s": 60}),
    ({}, {"signal": "SIGUSR1", "grace_s": 120}),
    ({"grace_s": 60, "interval_s": 1800}, {"signal": "SIGUSR1", "grace_s": 60, "interval_s": 1800}),
    ({"interval_s": None}, {"signal": "SIGUSR1", "grace_s": 120}),
    (None, None),
])
def test_a_checkpoint_is_stored_and_shown(alice, given, stored):
    r = submit(alice, checkpoint=given)
    assert r.status_code == 201, r.json()
    assert r.json()["checkpoint"] == stored
    job = Job.objects.get(pk=r.json()["id"])
    assert job.checkpoint == stored and job.checkpoint_signal == (stored or {}).get("signal", "")
    assert job.checkpoint_interval_s == (stored or {}).get("interval_s")


@pytest.mark.parametrize("given,field,text", [
    ({"signal": "SIGKILL"}, "checkpoint.signal", "not a valid choice"),
    ({"signal": "USR1"}, "checkpoint.signal", "not a valid choice"),
    ({"grace_s": 0}, "checkpoint.grace_s", "greater than or equal to 1"),
    ({"grace_s": "soon"}, "checkpoint.grace_s", "valid integer"),
    ({"grace_s": 901}, "checkpoint.grace_s", "At most 900 seconds"),
    ({"grace_s": 600}, "checkpoint.grace_s", "not under the job's time limit of 600 s"),
    ({"interval": 60}, "checkpoint.interval", ""),
    ({"interval_s": 0}, "checkpoint.interval_s", "greater than or equal to 1"),
    ({"interval_s": -600}, "checkpoint.interval_s", "greater than or equal to 1"),
    ({"interval_s": "hourly"}, "checkpoint.interval_s", "valid integer"),
    ({"interval_s": 1.5}, "checkpoint.interval_s", "valid integer"),
    ({"interval_s": True}, "checkpoint.interval_s", "valid integer"),
    ("SIGUSR1", "checkpoint.non_field_errors", "Expected a dictionary"),
])
def test_bad_checkpoints_are_400_naming_the_field(alice, given, field, text):
    r = submit(alice, time_limit=600, checkpoint=given)
    assert r.status_code == 400, r.json()
    fields = r.json()["error"]["fields"]
    assert field in fields and text in " ".join(fields[field]), fields
    assert not Job.objects.exists()


def test_a_resubmit_keeps_the_checkpoint(alice):
    job = submit(alice, checkpoint={"signal": "SIGTERM", "grace_s": 30}).json()
    alice.post(f"/api/v1/jobs/{job['id']}/cancel/")
    again = alice.post(f"/api/v1/jobs/{job['id']}/resubmit/")
    assert again.status_code == 201 and again.json()["checkpoint"] == {"signal": "SIGTERM", "grace_s": 30}


def test_a_resubmit_keeps_the_save_interval(alice):
    job = submit(alice, checkpoint={"grace_s": 30, "interval_s": 900}).json()
    alice.post(f"/api/v1/jobs/{job['id']}/cancel/")
    again = alice.post(f"/api/v1/jobs/{job['id']}/resubmit/")
    assert again.status_code == 201 and again.json()["checkpoint"] == {"signal": "SIGUSR1", "grace_s": 30,
                                                                       "interval_s": 900}


def test_the_openapi_schema_shows_the_save_interval(client, db):
    import yaml

    schemas = yaml.safe_load(client.get("/api/schema/").content)["components"]["schemas"]
    asked = schemas["CheckpointRequest"]["properties"]["interval_s"]
    assert asked["type"] == "integer" and asked["minimum"] == 1 and asked["nullable"] is True
    assert "GPUPORTAL_CHECKPOINT_INTERVAL_S" in asked["description"]
    shown = schemas["JobCheckpoint"]["properties"]
    assert shown["interval_s"]["type"] == "integer" and "interval_s" not in schemas["JobCheckpoint"]["required"]
