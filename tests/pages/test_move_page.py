"""The job page's "Move job" button: staff only, on a job that holds GPUs (docs/jobs.md, "Checkpoints")."""
import pytest

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

pytestmark = pytest.mark.django_db


@pytest.fixture
def running(demo, submit, sent, passes_here):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    job = submit(resources={"gpus": 1}, checkpoint={"signal": "SIGUSR2", "grace_s": 30})
    run_pass()
    assert Job.objects.get(pk=job.pk).state == "assigned"
    sent.clear()
    return job, sent


def test_staff_see_the_button_and_move_the_job(demo, browser, running, django_capture_on_commit_callbacks):
    job, sent = running
    assert "Move job" not in browser("alice").get(f"/jobs/{job.pk}/").content.decode()  # its owner: no operator
    page = browser("admin").get(f"/jobs/{job.pk}/").content.decode()
    assert "Move job" in page and "checkpoints on SIGUSR2 (30 s to save)" in page
    with django_capture_on_commit_callbacks(execute=True):
        assert browser("admin").post(f"/jobs/{job.pk}/move/").status_code == 302
    job.refresh_from_db()
    assert (job.state, job.attempt, job.reason_code) == ("queued", 2, "moved")
    assert [(task, args[1:]) for task, _, args in sent] == [("agent.stop", [1, "moved", 30, "SIGUSR2"])]
    assert "Move job" not in browser("admin").get(f"/jobs/{job.pk}/").content.decode()  # queued: nothing to move


@pytest.mark.parametrize("who,status", [("alice", 403), ("charlie", 404)])
def test_others_cannot_move_it(demo, browser, running, who, status):
    job, sent = running
    assert browser(who).post(f"/jobs/{job.pk}/move/").status_code == status  # alice: no operator; charlie: not his tenant
    assert Job.objects.get(pk=job.pk).state == "assigned" and sent == []
