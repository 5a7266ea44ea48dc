"""Hold, update and release a queued job from its page, and the cluster page, in a real Chromium."""
import re

import pytest
from playwright.sync_api import expect

from .conftest import in_db_thread, shot
from .test_portal_e2e import job_id_of, node, schedule, submit_with_form  # noqa: F401 - node is a fixture

pytestmark = pytest.mark.django_db(transaction=True)


def job_row(job_id):
    from portal.jobs.models import Job

    return Job.objects.values("state", "held", "time_limit_s", "priority", "gpus").get(pk=job_id)


def test_hold_update_and_release_from_the_job_page(node, login):  # noqa: F811
    page = login("alice")
    submit_with_form(page, "e2e-hold", gpus="1")
    job = job_id_of(page)
    page.get_by_role("button", name="Hold").click()
    expect(page.locator("#job-held")).to_contain_text("Held by alice")
    in_db_thread(schedule)
    assert in_db_thread(job_row, job)["state"] == "queued"

    page.get_by_text("Update while queued").click()
    page.get_by_label("New time limit").fill("30m")
    page.get_by_label("New priority").select_option("low")
    page.get_by_label("New GPU count").fill("2")
    shot(page, "job-update-form")
    page.get_by_role("button", name="Update job").click()
    expect(page.get_by_role("status").first).to_contain_text(f"Job {job} updated.")
    row = in_db_thread(job_row, job)
    assert (row["time_limit_s"], row["priority"], row["gpus"]) == (1800, "low", 2)

    page.get_by_role("button", name="Release").click()
    expect(page.get_by_role("status").first).to_contain_text(f"Job {job} released.")
    in_db_thread(schedule)
    expect(page.locator("#job-state")).to_have_text("Assigned")  # the status block polls


def test_cluster_page_for_a_viewer(node, login):  # noqa: F811
    page = login("dave")
    page.get_by_role("link", name="Cluster").click()
    expect(page).to_have_title(re.compile("Cluster"))
    expect(page.locator("#cluster-types")).to_contain_text("H100-80GB")
    shot(page, "cluster")
