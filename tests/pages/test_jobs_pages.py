"""Job pages through the test client: tenancy, the submit form's field messages, live fragments."""
import re

import pytest
from django.core.cache import cache

from portal.core.context import Actor
from portal.jobs.models import Job, JobLogChunk, JobTemplate
from portal.jobs.services import template_save
from portal.jobs.states import transition
from portal.nodes.services import node_add

IMAGE = "gpuportal/busybox:latest"
FORM = {"project": "vision", "name": "train", "image": IMAGE, "command": "python train.py --epochs 3",
        "priority": "normal", "sandbox": "docker"}


def test_list_shows_members_their_projects_jobs(demo, browser, submit):
    job = submit(name="alice-job")
    other = submit(user="charlie", project="nlp", name="charlie-job")
    page = browser("bob").get("/jobs/").content.decode()
    assert f'id="job-{job.pk}"' in page and "alice-job" in page
    assert "charlie-job" not in page and f'id="job-{other.pk}"' not in page


def test_outsider_sees_none_of_the_jobs_and_gets_404(demo, browser, submit):
    job = submit(name="alice-job")
    charlie = browser("charlie")
    assert "alice-job" not in charlie.get("/jobs/").content.decode()
    for url in (f"/jobs/{job.pk}/", f"/jobs/{job.pk}/status/", f"/jobs/{job.pk}/log/", f"/jobs/{job.pk}/metrics/"):
        assert charlie.get(url).status_code == 404, url
    assert charlie.post(f"/jobs/{job.pk}/cancel/").status_code == 404
    assert Job.objects.get(pk=job.pk).state == "queued"


def test_anonymous_is_sent_to_login(db, browser):
    response = browser().get("/jobs/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_list_filters_and_stable_order(demo, browser, submit):
    first, second = submit(name="a"), submit(name="b")
    Job.objects.filter(pk__in=[first.pk, second.pk]).update(submitted_at=first.submitted_at)
    mine = submit(user="bob", name="bobs")
    transition(first.pk, to="cancelled", from_states={"queued"})
    page = browser("alice").get("/jobs/").content.decode()
    ids = [int(i) for i in re.findall(r'<tr id="job-(\d+)"', page)]
    assert ids == [mine.pk, second.pk, first.pk]  # same submit time: the higher id first
    page = browser("alice").get("/jobs/?state=active").content.decode()
    assert f'id="job-{first.pk}"' not in page and f'id="job-{second.pk}"' in page
    page = browser("bob").get("/jobs/?mine=1").content.decode()
    assert re.findall(r'<tr id="job-(\d+)"', page) == [str(mine.pk)]
    page = browser("alice").get("/jobs/?project=nlp").content.decode()
    assert "No jobs match these filters." in page


def test_array_is_one_row_with_a_histogram(demo, browser, submit):
    parent = submit(name="sweep", array="0-3")
    task = parent.tasks.order_by("array_index").first()
    transition(task.pk, to="cancelled", from_states={"queued"})
    page = browser("alice").get("/jobs/").content.decode()
    assert len(re.findall(r'<tr id="job-', page)) == 1
    assert "array 0-3" in page and "3 queued" in page and "1 cancelled" in page


def test_poll_answers_204_when_nothing_changed_and_only_changed_rows_otherwise(demo, browser, submit):
    a, b = submit(name="a"), submit(name="b")
    client = browser("alice")
    page = client.get("/jobs/").content.decode()
    versions = re.search(r'hx-vals=\'\{"v": "([^"]*)"\}\'', page).group(1)
    headers = {"HX-Request": "true"}
    assert client.get("/jobs/", {"v": versions}, headers=headers).status_code == 204
    transition(a.pk, to="cancelled", from_states={"queued"})
    answer = client.get("/jobs/", {"v": versions}, headers=headers).content.decode()
    assert f'<tr id="job-{a.pk}" hx-swap-oob="true">' in answer and f'id="job-{b.pk}"' not in answer
    assert 'id="jobs-poller"' in answer
    submit(name="c")  # a new row: the whole body is replaced
    answer = client.get("/jobs/", {"v": versions}, headers=headers).content.decode()
    assert '<tbody id="job-rows" hx-swap-oob="true">' in answer


def test_submit_form_creates_the_job(demo, browser):
    response = browser("alice").post("/jobs/new/", {**FORM, "gpus": "2", "env": "SEED=1\nMODE=fast",
                                                    "time_limit": "2h"})
    job = Job.objects.get(name="train")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    assert job.command == ["python", "train.py", "--epochs", "3"] and job.env == {"SEED": "1", "MODE": "fast"}
    assert job.gpus == 2 and job.time_limit_s == 7200 and job.user.username == "alice"


def test_submit_form_shows_the_api_field_messages_next_to_the_fields(demo, browser):
    response = browser("alice").post("/jobs/new/", {**FORM, "gpus": "99"})
    page = response.content.decode()
    assert response.status_code == 200 and not Job.objects.exists()
    gpus_error = re.search(r'<ul class="errorlist" id="id_gpus_error"><li>([^<]*)</li>', page)
    assert gpus_error and "99 exceeds the project limit of 16" in gpus_error.group(1)
    assert re.search(r'<input[^>]*name="gpus"[^>]*aria-invalid="true"', page)
    assert 'value="python train.py --epochs 3"' in page  # what was typed is kept
    page = browser("alice").post("/jobs/new/", {**FORM, "env": "CUDA_VISIBLE_DEVICES=0",
                                                "image": "evil/miner:latest"}).content.decode()
    assert re.search(r'id="id_env_error"><li>CUDA_VISIBLE_DEVICES is reserved', page)
    page = browser("alice").post("/jobs/new/", {**FORM, "image": "evil/miner:latest"}).content.decode()
    assert re.search(r'id="id_image_error"><li>evil/miner:latest is not an allowed image', page)
    page = browser("alice").post("/jobs/new/", {**FORM, "command": "echo 'unclosed"}).content.decode()
    assert 'id="id_command_error"' in page and "Cannot split this command" in page


def test_submit_form_array_and_dependencies(demo, browser, submit):
    dep = submit(name="prep")
    browser("alice").post("/jobs/new/", {**FORM, "array": "0-4%2", "depends_on": f"{dep.pk}"})
    parent = Job.objects.get(name="train", is_array_parent=True)
    assert parent.tasks.count() == 5 and parent.array_limit == 2
    assert list(parent.depends_on.values_list("pk", flat=True)) == [dep.pk]
    page = browser("alice").post("/jobs/new/", {**FORM, "name": "x", "depends_on": "999999"}).content.decode()
    assert 'id="id_depends_on_error"' in page and "No job 999999" in page


def test_viewer_cannot_submit(demo, browser):
    assert "does not allow submitting" in browser("dave").get("/jobs/new/").content.decode()
    page = browser("dave").post("/jobs/new/", FORM).content.decode()
    assert "does not allow submitting" in page and not Job.objects.exists()


def test_submit_from_a_template_keeps_locked_fields(demo, browser):
    alice = Actor(user=demo.users["alice"])
    template = template_save(actor=alice, project=demo.vision, name="py", locked=["image"],
                             spec={"image": "gpuportal/python:3.11", "command": ["python", "-V"],
                                   "resources": {"gpus": 1}})
    page = browser("alice").get(f"/jobs/new/?template={template.pk}").content.decode()
    assert 'value="gpuportal/python:3.11"' in page and "Locked by the template." in page
    assert 'value="python -V"' in page
    browser("alice").post(f"/jobs/new/?template={template.pk}",
                          {**FORM, "image": "gpuportal/busybox:latest", "template": template.pk})
    job = Job.objects.get(name="train")
    assert job.image == "gpuportal/python:3.11" and job.template_id == template.pk
    # A template of another tenant does not exist for charlie.
    assert browser("charlie").get(f"/jobs/new/?template={template.pk}").status_code == 404
    assert JobTemplate.objects.count() == 1


def test_detail_shows_reason_timeline_and_log(demo, browser, submit):
    job = submit(name="j1")
    Job.objects.filter(pk=job.pk).update(reason_message="Waiting for 2 GPUs: project quota 4/4 in use",
                                         queue_position=3)
    JobLogChunk.objects.create(job=job, attempt=1, offset=0, data=b"hello <world>\n")
    page = browser("dave").get(f"/jobs/{job.pk}/").content.decode()
    assert "<title>Job" in page and "position 3 in the queue" in page and "project quota 4/4" in page
    assert "hello &lt;world&gt;" in page
    assert "Cancel job" not in page  # a viewer gets no buttons
    assert "Cancel job" in browser("alice").get(f"/jobs/{job.pk}/").content.decode()


def test_log_poll_appends_from_the_offset_and_keeps_working_after_the_end(demo, browser, submit):
    job = submit()
    JobLogChunk.objects.create(job=job, attempt=1, offset=0, data=b"one\n")
    client, hx = browser("alice"), {"HX-Request": "true"}
    assert client.get(f"/jobs/{job.pk}/log/", {"attempt": 1, "offset": 4}, headers=hx).status_code == 204
    JobLogChunk.objects.create(job=job, attempt=1, offset=4, data=b"two\n")
    transition(job.pk, to="succeeded", from_states={"queued"})
    answer = client.get(f"/jobs/{job.pk}/log/", {"attempt": 1, "offset": 4}, headers=hx).content.decode()
    assert 'hx-swap-oob="beforeend:#log-text">two\n</div>' in answer and "offset=8" in answer
    raw = client.get(f"/jobs/{job.pk}/log/")
    assert raw["Content-Type"].startswith("text/plain") and b"".join(raw.streaming_content) == b"one\ntwo\n"


def test_status_poll_is_204_until_the_job_changes(demo, browser, submit):
    job = submit()
    client, hx = browser("alice"), {"HX-Request": "true"}
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    v = re.search(r'id="job-status"[^>]*hx-vals=\'\{"v": "([0-9a-f]+)"\}\'', page).group(1)
    assert client.get(f"/jobs/{job.pk}/status/", {"v": v}, headers=hx).status_code == 204
    transition(job.pk, to="cancelled", from_states={"queued"}, message="Cancelled by test.")
    answer = client.get(f"/jobs/{job.pk}/status/", {"v": v}, headers=hx).content.decode()
    assert "Cancelled by test." in answer and "hx-trigger" not in answer  # terminal: polling stops


def test_metrics_reads_the_latest_sample_from_the_cache(demo, browser, submit, django_capture_on_commit_callbacks,
                                                         monkeypatch):
    from scheduler.adapter import run_pass

    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    job = submit(resources={"gpus": 1})
    with django_capture_on_commit_callbacks(execute=True):
        run_pass()
    job.refresh_from_db()
    gpu = job.allocations.get().gpu
    cache.set(f"gpu-sample:{gpu.uuid}", {"gpu_uuid": gpu.uuid, "ts": 1.0, "utilization": 87, "memory_used_mb": 1000,
                                          "power_w": 300.5, "processes": [{"pid": 1}]})
    body = browser("alice").get(f"/jobs/{job.pk}/metrics/").json()
    assert body["live"] is True
    (g,) = body["gpus"]
    assert g["sample"]["utilization"] == 87 and g["sample"]["power_w"] == 300.5 and "processes" not in g["sample"]
    page = browser("alice").get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="gpu-charts"' in page and "uPlot.iife.min.js" in page and ">87<" in page


@pytest.mark.parametrize("who,status,state", [("alice", 302, "cancelled"), ("bob", 403, "queued"),
                                              ("dave", 403, "queued"), ("admin", 302, "cancelled")])
def test_cancel_button(demo, browser, submit, who, status, state):
    job = submit()
    assert browser(who).post(f"/jobs/{job.pk}/cancel/").status_code == status
    assert Job.objects.get(pk=job.pk).state == state


def test_cancel_and_resubmit_need_csrf(demo, browser, submit):
    job = submit()
    client = browser("alice", csrf=True)
    assert client.post(f"/jobs/{job.pk}/cancel/").status_code == 403
    assert client.post(f"/jobs/{job.pk}/resubmit/").status_code == 403
    assert Job.objects.get(pk=job.pk).state == "queued" and Job.objects.count() == 1
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    assert client.post(f"/jobs/{job.pk}/cancel/", {"csrfmiddlewaretoken": token}).status_code == 302
    assert Job.objects.get(pk=job.pk).state == "cancelled"


def test_cancel_of_a_finished_job_goes_back_with_the_message(demo, browser, submit):
    job = submit()
    transition(job.pk, to="succeeded", from_states={"queued"})
    response = browser("alice").post(f"/jobs/{job.pk}/cancel/", follow=True)
    assert "cannot be cancelled" in response.content.decode()


def test_resubmit_links_the_new_job(demo, browser, submit):
    job = submit(name="again")
    transition(job.pk, to="failed", from_states={"queued"})
    response = browser("alice").post(f"/jobs/{job.pk}/resubmit/")
    new = Job.objects.exclude(pk=job.pk).get()
    assert response["Location"] == f"/jobs/{new.pk}/" and new.resubmit_of_id == job.pk


def test_bulk_cancel_asks_first_then_cancels(demo, browser, submit):
    a, b, theirs = submit(name="a"), submit(name="b"), submit(user="charlie", project="nlp")
    client = browser("alice")
    confirm = client.post("/jobs/cancel/", {"ids": [a.pk, b.pk, theirs.pk], "back": "/jobs/?state=active"})
    page = confirm.content.decode()
    assert confirm.status_code == 200 and "Cancel 2 jobs?" in page and f'value="{theirs.pk}"' not in page
    assert Job.objects.filter(state="cancelled").count() == 0
    done = client.post("/jobs/cancel/", {"ids": [a.pk, b.pk, theirs.pk], "confirm": "yes",
                                         "back": "https://evil.example/"})
    assert done.status_code == 302 and done["Location"] == "/jobs/"
    assert set(Job.objects.filter(state="cancelled").values_list("pk", flat=True)) == {a.pk, b.pk}
    assert Job.objects.get(pk=theirs.pk).state == "queued"


def test_submit_form_spans_nodes_only_when_asked_and_templates_carry_it(demo, browser):
    for name in ("gpu-01", "gpu-02"):
        node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus="4xH100-80GB")
    response = browser("alice").post("/jobs/new/", {**FORM, "nodes": "2", "gpus_per_node": "4"})
    job = Job.objects.get(name="train")
    assert response.status_code == 302 and (job.nodes, job.gpus) == (2, 8)
    assert "8 GPUs on 2 nodes (4 each)" in browser("alice").get(f"/jobs/{job.pk}/").content.decode()
    page = browser("alice").post("/jobs/new/", {**FORM, "name": "wide", "nodes": "3", "gpus_per_node": "1"}
                                 ).content.decode()
    assert re.search(r'id="id_nodes_error"><li>3 exceeds the 2 node\(s\) with GPUs in the cluster', page)
    page = browser("alice").post("/jobs/new/", {**FORM, "name": "big", "gpus": "8"}).content.decode()
    assert re.search(r'id="id_gpus_error"><li>8 GPUs on one node, but the largest node has 4 GPUs', page)
    assert not Job.objects.filter(name__in=["wide", "big"]).exists()
    template = template_save(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="ddp", locked=[],
                             spec={"image": IMAGE, "resources": {"nodes": 2, "gpus_per_node": 2}})
    page = browser("alice").get(f"/jobs/new/?template={template.pk}").content.decode()
    assert re.search(r'<input[^>]*name="nodes"[^>]*value="2"', page)
    assert re.search(r'<input[^>]*name="gpus_per_node"[^>]*value="2"', page)
