"""The portal in a real headless Chromium: submit, watch, cancel, tokens, isolation, form errors.

No agent runs: a background thread plays the scheduler and the agent (run_pass, transitions,
log chunks) and the pages must pick the changes up by polling.
"""
import re

import pytest
from playwright.sync_api import expect

from .conftest import in_db_thread, shot

pytestmark = pytest.mark.django_db(transaction=True)
IMAGE = "gpuportal/busybox:latest"


@pytest.fixture
def node(demo):
    from portal.core.context import Actor
    from portal.nodes.services import node_add

    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="4xH100-80GB")
    return node


def submit_with_form(page, name, gpus="1"):
    page.goto("/jobs/new/")
    page.get_by_label("Project", exact=True).select_option("vision")
    page.get_by_label("Name", exact=True).fill(name)
    page.get_by_label("Image", exact=True).fill(IMAGE)
    page.get_by_label("Command", exact=True).fill("python train.py --epochs 2")
    page.get_by_label("GPUs", exact=True).fill(gpus)
    page.get_by_role("button", name="Submit job").click()


def job_id_of(page) -> int:
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    return int(re.search(r"/jobs/(\d+)/$", page.url).group(1))


# What the scheduler and the agent would do, run from a background thread.


def schedule():
    from scheduler.adapter import run_pass

    return run_pass()


def agent_starts(job_id, first_line):
    """The agent starts the job, its heartbeat leaves a sample per GPU in the cache, and it ships a log line."""
    import time

    from django.core.cache import cache

    from portal.jobs.models import Allocation, JobLogChunk
    from portal.jobs.states import transition

    for uuid in Allocation.objects.filter(job_id=job_id).values_list("gpu__uuid", flat=True):
        sample = {"gpu_uuid": uuid, "ts": time.time(), "utilization": 87, "memory_used_mb": 40960,
                  "memory_total_mb": 81920, "temperature_c": 64, "power_w": 512.5, "power_limit_w": 700.0,
                  "processes": [{"pid": 4242}]}
        cache.set(f"gpu-sample:{uuid}", sample, 300)
    assert transition(job_id, to="starting", from_states={"assigned"})
    assert transition(job_id, to="running", from_states={"starting"})
    JobLogChunk.objects.create(job_id=job_id, attempt=1, offset=0, data=first_line.encode())


def agent_finishes(job_id, offset, last_line):
    from portal.jobs.models import JobLogChunk
    from portal.jobs.states import transition

    JobLogChunk.objects.create(job_id=job_id, attempt=1, offset=offset, data=last_line.encode())
    assert transition(job_id, to="succeeded", from_states={"running"}, exit_code=0, message="Exit code 0.")


def job_state(job_id):
    from portal.jobs.models import Job

    return Job.objects.get(pk=job_id).state


def test_submit_and_watch_a_job_succeed_with_its_log(node, login):
    page = login("alice")
    shot(page, "dashboard-empty")
    submit_with_form(page, "e2e-train")
    job_id = job_id_of(page)
    expect(page).to_have_title(re.compile(rf"Job {job_id} e2e-train"))
    expect(page.get_by_role("status").first).to_contain_text(f"Job {job_id} submitted.")
    expect(page.locator("#job-state")).to_have_text("Queued")

    expect(page.locator("#job-gpus")).to_contain_text("No GPUs allocated yet.")

    in_db_thread(schedule)
    expect(page.locator("#job-state")).to_have_text("Assigned")
    expect(page.locator("#job-status")).to_contain_text("gpu-01")
    expect(page.locator("#job-gpus")).to_contain_text("gpu-01/gpu")  # swapped in with the status

    first = "epoch 1/2 loss=0.91\n"
    in_db_thread(agent_starts, job_id, first)
    expect(page.locator("#job-state")).to_have_text("Running")
    expect(page.locator("#log-text")).to_contain_text("epoch 1/2 loss=0.91")
    expect(page.locator("#job-gpus [data-k=utilization]")).to_have_text("87")
    expect(page.locator("#gpu-charts canvas")).to_have_count(3)  # uPlot: utilization, memory, power
    expect(page.locator("#gpu-charts")).to_be_visible()
    shot(page, "job-running")

    in_db_thread(agent_finishes, job_id, len(first.encode()), "epoch 2/2 loss=0.47\ndone\n")
    expect(page.locator("#job-state")).to_have_text("Succeeded")
    expect(page.locator("#log-text")).to_have_text("epoch 1/2 loss=0.91\nepoch 2/2 loss=0.47\ndone\n")
    expect(page.locator("#job-status .timeline")).to_contain_text("Exit code 0.")
    expect(page.get_by_role("button", name="Resubmit")).to_be_visible()
    expect(page.get_by_role("button", name="Cancel job")).to_have_count(0)
    shot(page, "job-succeeded")

    # A finished job's page still shows its whole log.
    page.reload()
    expect(page.locator("#log-text")).to_contain_text("done")
    page.goto("/")
    expect(page.locator("#finished-h").locator("..")).to_contain_text("e2e-train")
    shot(page, "dashboard")


def test_cancel_from_the_job_page_and_in_bulk_from_the_list(node, login):
    page = login("alice")
    submit_with_form(page, "e2e-cancel-me")
    single = job_id_of(page)
    page.get_by_role("button", name="Cancel job").click()
    expect(page.get_by_role("status").first).to_contain_text(f"Job {single} cancelled.")
    expect(page.locator("#job-state")).to_have_text("Cancelled")
    assert in_db_thread(job_state, single) == "cancelled"

    submit_with_form(page, "e2e-bulk")
    bulk = job_id_of(page)
    page.goto("/jobs/")
    row = page.locator(f"#job-{bulk}")
    expect(row).to_contain_text("Queued")
    in_db_thread(schedule)  # the row changes under the reader's eyes (htmx poll, out-of-band row swap)
    expect(row).to_contain_text("Assigned")
    expect(row).to_contain_text("gpu-01")
    shot(page, "job-list")
    page.get_by_label(f"Select job {bulk} (e2e-bulk)").check()
    page.get_by_role("button", name="Cancel selected jobs…").click()
    expect(page).to_have_title(re.compile("Cancel 1 job"))
    assert in_db_thread(job_state, bulk) == "assigned"  # nothing happens before the confirmation
    shot(page, "bulk-cancel-confirm")
    page.get_by_role("button", name="Yes, cancel 1 job").click()
    expect(page.get_by_role("status").first).to_contain_text(f"Cancelled 1 job: {bulk}.")
    expect(page.locator(f"#job-{bulk}")).to_contain_text("Cancelled")
    assert in_db_thread(job_state, bulk) == "cancelled"


def test_create_and_revoke_a_token(login):
    page = login("alice")
    page.get_by_role("link", name="Tokens").click()
    expect(page).to_have_title(re.compile("API tokens"))
    page.get_by_label("Name", exact=True).fill("e2e laptop")
    page.get_by_role("button", name="Create token").click()
    secret = page.get_by_label("Secret of token e2e laptop")
    expect(secret).to_have_value(re.compile(r"^gpp_[A-Za-z0-9]{42}$"))
    page.get_by_role("button", name="Copy").click()
    expect(page.locator("#copy-status")).not_to_be_empty()
    shot(page, "token-created")
    row = page.locator("#tokens-table tbody tr", has_text="e2e laptop")
    expect(row).to_contain_text("active")
    row.get_by_role("button", name="Revoke token e2e laptop").click()
    expect(page.get_by_role("status").first).to_contain_text("revoked")
    expect(page.locator("#tokens-table tbody tr", has_text="e2e laptop")).to_contain_text("revoked")
    expect(page.get_by_label("Secret of token e2e laptop")).to_have_count(0)  # shown once only


def test_charlie_sees_none_of_alices_jobs(node, login):
    alice = login("alice")
    submit_with_form(alice, "alice-secret-job")
    job_id = job_id_of(alice)
    charlie = login("charlie")
    charlie.goto("/jobs/")
    expect(charlie.locator("#job-rows")).to_contain_text("No jobs match these filters.")
    expect(charlie.locator("body")).not_to_contain_text("alice-secret-job")
    response = charlie.goto(f"/jobs/{job_id}/")
    assert response.status == 404
    assert charlie.goto("/projects/vision/").status == 404
    charlie.goto("/")
    expect(charlie.locator("main")).not_to_contain_text("vision")


def test_bad_submit_shows_the_field_error(login):
    page = login("alice")
    submit_with_form(page, "too-big", gpus="99")
    gpus = page.get_by_label("GPUs", exact=True)
    expect(gpus).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#id_gpus_error")).to_have_text("99 exceeds the project limit of 16.")
    expect(page.get_by_label("Name", exact=True)).to_have_value("too-big")
    shot(page, "submit-error")


def test_pages_work_without_javascript(node, login):
    """htmx only enhances: plain links and forms do everything."""
    page = login("bob", javascript=False)
    submit_with_form(page, "no-js")
    job_id = job_id_of(page)
    expect(page.locator("#job-state")).to_have_text("Queued")
    in_db_thread(schedule)
    page.reload()  # no polling without JavaScript: a reload shows the news
    expect(page.locator("#job-state")).to_have_text("Assigned")
    page.get_by_role("button", name="Cancel job").click()
    expect(page.locator("#job-state")).to_have_text("Cancelled")
    page.goto("/jobs/?state=finished&mine=1")
    expect(page.locator(f"#job-{job_id}")).to_contain_text("Cancelled")
    page.get_by_label("State").select_option("active")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"state=active"))
    expect(page.locator("#job-rows")).to_contain_text("No jobs match these filters.")


def test_main_pages_show_their_content_without_errors(node, login):
    """The project, submit and nodes pages show what they are for (members, the spec fields, the
    node's GPUs), and the browser reports no error on them (console or uncaught script error).
    Each page is kept as a picture for people to look at (test-artifacts/e2e/)."""
    errors = []

    def watch(page):
        page.on("console", lambda msg: errors.append(f"{page.url}: {msg.text}") if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(f"{page.url}: {exc}"))
        return page

    page = watch(login("alice"))
    page.goto("/projects/vision/")
    expect(page).to_have_title(re.compile("Project vision"))
    members = page.locator("section[aria-labelledby=members-h] table")
    for username in ("alice", "bob", "dave"):
        expect(members).to_contain_text(username)
    expect(members).not_to_contain_text("charlie")
    shot(page, "project")
    page.goto("/jobs/new/")
    for field in ("Project", "Name", "Image", "Command", "GPUs"):
        expect(page.get_by_label(field, exact=True)).to_be_editable()
    expect(page.get_by_role("button", name="Submit job")).to_be_enabled()
    shot(page, "submit")
    admin = watch(login("admin"))
    admin.goto("/nodes/")
    expect(admin.locator("#node-gpu-01")).to_contain_text("gpu-01")
    expect(admin.locator("main table").first.locator("tbody tr")).to_have_count(4)  # 4xH100-80GB
    shot(admin, "nodes")
    assert errors == []
