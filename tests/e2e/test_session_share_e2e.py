"""The owner changes who may connect to a session from its dashboard card in Chromium (htmx swaps
the card's part, CSP allows it), a bad name shows on its field; others get 404 on the form."""
import pytest
from playwright.sync_api import expect

from .conftest import shot

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lab(demo, monkeypatch):
    from portal.core.context import Actor
    from portal.jobs.services import job_submit

    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "nb", "image": "gpuportal/busybox:latest", "command": ["jupyter", "lab"],
        "ports": [{"name": "lab", "kind": "jupyter"}]})
    return job.sessions.get().pk


def test_the_owner_shares_a_session_from_its_card(lab, login, live_server):
    page = login("alice")
    share = page.locator(f"#session-share-{lab}")
    expect(share.locator(".share-now")).to_have_text("Who may connect: only you.")
    share.get_by_text("Change sharing").click()
    share.get_by_label("Also these people").fill("bob, nobody-such")
    share.get_by_role("button", name="Save sharing").click()
    expect(page.locator(f"#share-{lab}-users_error")).to_have_text(
        "No user named 'nobody-such' in this job's organization.")
    expect(share.get_by_label("Also these people")).to_have_attribute("aria-invalid", "true")
    assert page.url == f"{live_server.url}/"  # swapped in place, no navigation
    shot(page, "session-share-error")
    share.get_by_label("Everyone in vision").check()
    share.get_by_label("Also these people").fill("bob")
    share.get_by_role("button", name="Save sharing").click()
    expect(share.locator(".share-now")).to_have_text("Who may connect: everyone in vision, and bob. Saved.")
    shot(page, "session-share")

    bob = login("bob")
    expect(bob.locator(".session-card")).to_contain_text("Shared with you by alice.")
    assert bob.goto(f"/session-sharing/{lab}/").status == 404
    assert login("charlie").goto(f"/session-sharing/{lab}/").status == 404


@pytest.fixture
def lab_job(lab):
    """The lab's job id, read before the browser's event loop runs (no ORM inside it)."""
    from portal.interactive.models import Session

    return Session.objects.get(pk=lab).job_id


def test_the_owner_shares_a_session_from_its_job_page(lab, lab_job, login, live_server):
    job = lab_job
    page = login("alice")
    page.goto(f"/jobs/{job}/")
    share = page.locator(f"#session-share-{lab}")
    expect(page.locator(".session-card h3")).to_have_text("JupyterLab · lab")
    share.get_by_text("Change sharing").click()
    share.get_by_label("Everyone in vision").check()
    share.get_by_role("button", name="Save sharing").click()
    expect(share.locator(".share-now")).to_have_text("Who may connect: everyone in vision. Saved.")
    assert page.url == f"{live_server.url}/jobs/{job}/"  # swapped in place on the job page
    shot(page, "session-share-job-page")

    bob = login("bob")
    bob.goto(f"/jobs/{job}/")
    expect(bob.locator(".session-card")).to_contain_text("Shared with you by alice.")
    expect(bob.locator(f"#session-share-{lab}")).to_have_count(0)
    assert login("charlie").goto(f"/jobs/{job}/").status == 404
