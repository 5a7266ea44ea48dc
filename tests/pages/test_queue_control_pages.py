"""The job page's hold, release and update controls, and the list's task ids, exit codes and elapsed time."""
from datetime import timedelta

from django.utils import timezone

from portal.core.models import AuditEvent
from portal.jobs.models import Job, JobState
from portal.jobs.states import transition


def test_hold_and_release_buttons_on_a_queued_job(demo, browser, submit):
    job = submit(user="bob")
    page = browser("bob").get(f"/jobs/{job.pk}/").content.decode()
    assert f'action="/jobs/{job.pk}/hold/"' in page and "Update while queued" in page
    response = browser("bob").post(f"/jobs/{job.pk}/hold/")
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.held and job.reason_code == "held"
    page = browser("bob").get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="job-held"' in page and f'action="/jobs/{job.pk}/release/"' in page
    browser("bob").post(f"/jobs/{job.pk}/release/")
    job.refresh_from_db()
    assert not job.held
    assert AuditEvent.objects.filter(object_id=str(job.pk), action__in=["job.hold", "job.release"]).count() == 2


def test_no_controls_once_placed_and_outsider_gets_404(demo, browser, submit):
    job = submit(user="bob")
    transition(job.pk, to=JobState.CANCELLED, from_states={JobState.QUEUED})
    page = browser("bob").get(f"/jobs/{job.pk}/").content.decode()
    assert "/hold/" not in page and "Update while queued" not in page
    queued = submit(user="bob")
    for action in ("hold", "release", "update"):
        assert browser("charlie").post(f"/jobs/{queued.pk}/{action}/", {"priority": "low"}).status_code == 404
    assert "/hold/" not in browser("dave").get(f"/jobs/{queued.pk}/").content.decode()  # a viewer
    queued.refresh_from_db()
    assert not queued.held and queued.priority == "normal"


def test_update_form_lists_every_refused_field(demo, browser, submit):
    job = submit(user="bob", resources={"gpus": 1})
    response = browser("bob").post(f"/jobs/{job.pk}/update/", {"time_limit": "soon", "priority": "high",
                                                                "gpus": "lots"}, follow=True)
    page = response.content.decode()
    assert "time_limit:" in page and "resources.gpus:" in page
    response = browser("bob").post(f"/jobs/{job.pk}/update/", {"time_limit": "2h", "priority": "high",
                                                                "gpus": "64"}, follow=True)
    page = response.content.decode()
    assert "time_limit:" in page and "priority:" in page and "resources.gpus:" in page
    job.refresh_from_db()
    assert (job.time_limit_s, job.priority, job.gpus) == (3600, "normal", 1)
    browser("bob").post(f"/jobs/{job.pk}/update/", {"time_limit": "30m", "priority": "low", "gpus": "2"})
    job.refresh_from_db()
    assert (job.time_limit_s, job.priority, job.gpus) == (1800, "low", 2)


def test_list_shows_task_ids_exit_code_reason_and_elapsed(demo, browser, submit):
    parent = submit(name="sweep", array="0-1")
    task = Job.objects.get(array_parent=parent, array_index=1)
    failed = submit(name="crash")
    start = timezone.now() - timedelta(minutes=75)
    Job.objects.filter(pk=failed.pk).update(state=JobState.RUNNING, started_at=start)
    transition(failed.pk, to=JobState.FAILED, from_states={JobState.RUNNING}, exit_code=137,
               reason_code="failed", reason_message="Killed by signal 9", ended_at=start + timedelta(minutes=65))
    page = browser("alice").get("/jobs/").content.decode()
    row = page.split(f'id="job-{failed.pk}"')[1].split("</tr>")[0]
    assert "exit 137: " in row and "Killed by signal 9" in row and "1h05m" in row
    assert "<th scope=\"col\" class=\"num\">Elapsed</th>" in page
    page = browser("alice").get(f"/jobs/{parent.pk}/").content.decode()
    assert f'<a href="/jobs/{task.pk}/">{parent.pk}_1</a>' in page
    page = browser("alice").get(f"/jobs/{task.pk}/").content.decode()
    assert f"<h1>Job {parent.pk}_1 · sweep</h1>" in page


def test_submit_form_lists_its_own_and_the_apis_errors_together(demo, browser):
    import re

    form = {"project": "vision", "name": "", "image": "evil/miner:latest", "command": "echo 'unclosed",
            "priority": "normal", "sandbox": "docker", "gpus": "99", "time_limit": "30d"}
    page = browser("alice").post("/jobs/new/", form).content.decode()
    assert not Job.objects.exists()
    for name, text in (("command", "Cannot split this command"), ("image", "is not an allowed image"),
                       ("gpus", "99 exceeds the project limit of 16"), ("time_limit", "exceeds the project maximum")):
        assert re.search(rf'id="id_{name}_error"><li>[^<]*{text}', page), name
    assert 'id="id_name_error"' not in page  # name is optional


def test_submit_form_without_a_name_names_the_job_after_its_program(demo, browser):
    form = {"project": "vision", "name": "", "image": "gpuportal/busybox:latest", "command": "python train.py",
            "priority": "normal", "sandbox": "docker"}
    response = browser("alice").post("/jobs/new/", form)
    assert response.status_code == 302
    assert Job.objects.get().name == "python"
