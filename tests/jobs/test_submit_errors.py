"""A submit reports every field error at once, and `name` is optional (the command's program)."""
import pytest

from portal.jobs.models import Job

IMAGE = "gpuportal/busybox:latest"


def submit(client, body):
    return client.post("/api/v1/jobs/", data=body, format="json")


@pytest.fixture
def alice(demo, api):
    return api("alice")


def test_every_field_error_is_reported_at_once(alice):
    r = submit(alice, {"project": "vision", "image": "evil/miner:latest", "command": [], "time_limit": "soon",
                       "resources": {"gpus": 64}, "priority": "urgent", "network": True})
    assert r.status_code == 400
    fields = r.json()["error"]["fields"]
    assert set(fields) == {"image", "command", "time_limit", "resources.gpus", "priority", "network"}, fields
    assert "not an allowed image" in fields["image"][0]
    assert "exceeds the project limit of 16" in fields["resources.gpus"][0]
    assert not Job.objects.exists()


def test_unknown_keys_and_bad_fields_together(alice):
    r = submit(alice, {"project": "vision", "image": IMAGE, "command": "not a list", "colour": "blue",
                       "resources": {"gpus": "1.5"}})
    fields = r.json()["error"]["fields"]
    assert r.status_code == 400 and {"colour", "command", "resources.gpus"} <= set(fields), fields


def test_a_bad_project_comes_with_the_other_errors(alice):
    r = submit(alice, {"project": "nlp", "image": "Not An Image", "command": ["true"]})
    fields = r.json()["error"]["fields"]
    assert r.status_code == 400 and set(fields) == {"project", "image"}, fields
    assert "No project named 'nlp'" in fields["project"][0]  # another tenant's project does not exist


@pytest.mark.parametrize("command,name", [
    (["python", "train.py"], "python"), (["/usr/bin/env", "bash"], "env"), (["./run.sh"], "run.sh"),
    (["/"], "job"), (["a\u200bb"], "job"),
])
def test_name_defaults_to_the_commands_program(alice, command, name):
    r = submit(alice, {"project": "vision", "image": IMAGE, "command": command})
    assert r.status_code == 201, r.content
    assert r.json()["name"] == name


def test_a_given_name_is_kept(alice):
    r = submit(alice, {"project": "vision", "name": "mine", "image": IMAGE, "command": ["python"]})
    assert r.status_code == 201 and r.json()["name"] == "mine"


def test_the_submit_service_refuses_with_the_services_own_error(demo):
    """Services raise one family of errors (portal.core.errors), never DRF's: a page, a
    management command or a task calling job_submit catches ServiceError alone and still gets
    every field's message, flattened as the API reports them."""
    from portal.core.context import Actor
    from portal.core.errors import InvalidInput
    from portal.jobs.services import job_submit

    with pytest.raises(InvalidInput) as refusal:
        job_submit(actor=Actor(user=demo.users["alice"]), data={
            "project": "vision", "image": IMAGE, "command": [], "resources": {"gpus": 64}})
    fields = refusal.value.as_fields()
    assert set(fields) == {"command", "resources.gpus"}, fields
    assert refusal.value.status == 400 and refusal.value.message.startswith("Invalid input: ")
    assert not Job.objects.exists()
