"""The sharing form on a session's card (portal/pages/sessions.py): the owner sees who may connect
and changes it; a bad name is a message on its field; anyone else gets 404 on the form's URL."""
import pytest
from django.test import Client
from django.urls import reverse

from portal.core.context import Actor
from portal.interactive.models import Session
from portal.jobs.services import job_submit


@pytest.fixture(autouse=True)
def no_dispatch(monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)


@pytest.fixture
def lab(demo):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "nb", "image": "gpuportal/busybox:latest", "command": ["jupyter", "lab"],
        "ports": [{"name": "lab", "kind": "jupyter"}]})
    return Session.objects.get(job=job)


def browser(user) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def post(client, url, data, *, htmx=True):
    """Post the form as a browser does: the CSRF token taken from the page it came from."""
    page = client.get(url)
    assert page.status_code == 200
    token = page.cookies["csrftoken"].value if "csrftoken" in page.cookies else client.cookies["csrftoken"].value
    headers = {"HX-Request": "true"} if htmx else {}
    return client.post(url, {**data, "csrfmiddlewaretoken": token}, headers=headers)


def test_the_owner_shares_a_session_from_its_card(demo, lab):
    from django.contrib.auth import get_user_model

    from portal.tenancy.models import Membership, Project

    erin = get_user_model().objects.create_user("erin", password="x-erin-pass-123")
    audio = Project.objects.create(organization=demo.vision.organization, slug="audio", name="Audio")
    Membership.objects.create(project=audio, user=erin, role="member")
    alice = browser(demo.users["alice"])
    url = reverse("session-share", args=[lab.pk])
    home = alice.get("/").content.decode()
    assert "Who may connect: only you." in home and f'hx-post="{url}"' in home

    # An unknown name and another tenant's user: a message on the users field, nothing saved.
    for names in ("erin, nobody-such", "charlie"):
        r = post(alice, url, {"share": "project", "users": names})
        assert r.status_code == 200
        html = r.content.decode()
        bad = names.split(", ")[-1]
        assert f"No user named &#x27;{bad}&#x27; in this job&#x27;s organization." in html
        assert 'aria-invalid="true"' in html and f'value="{names}"' in html
        assert "<html" not in html  # htmx gets the card's part only
    lab.refresh_from_db()
    assert lab.share == "owner" and not lab.shared_users.exists()

    r = post(alice, url, {"share": "everyone", "users": ""})
    assert r.status_code == 200 and "Select a valid choice." in r.content.decode()

    r = post(alice, url, {"share": "project", "users": "erin  erin,"})
    assert r.status_code == 200
    assert "Who may connect: everyone in vision, and erin." in r.content.decode() and "Saved." in r.content.decode()
    lab.refresh_from_db()
    assert lab.share == "project" and [u.username for u in lab.shared_users.all()] == ["erin"]
    assert "Who may connect: everyone in vision, and erin." in alice.get("/").content.decode()
    # Those it is shared with see the card, not the form.
    erin_home = browser(erin).get("/").content.decode()
    assert "Shared with you by alice." in erin_home and url not in erin_home

    # Without htmx: the form's own page, then back to the dashboard with a message.
    assert "<html" in alice.get(url).content.decode()
    r = post(alice, url, {"share": "owner", "users": ""}, htmx=False)
    assert r.status_code == 302 and r["Location"] == reverse("home")
    lab.refresh_from_db()
    assert lab.share == "owner" and not lab.shared_users.exists()
    assert "Sharing of lab (job" in alice.get("/").content.decode()


@pytest.mark.parametrize("who", ["bob", "charlie", "admin"])
def test_only_the_owner_reaches_the_form(demo, lab, who):
    """bob is in the job's project (and sees the session once shared), admin is staff, charlie
    another tenant: the form is 404 to each, read or posted."""
    lab.share = "project"
    lab.save(update_fields=["share"])
    client = Client()
    client.force_login(demo.users[who])
    url = reverse("session-share", args=[lab.pk])
    assert client.get(url).status_code == 404
    assert client.post(url, {"share": "owner", "users": who}, headers={"HX-Request": "true"}).status_code == 404
    lab.refresh_from_db()
    assert lab.share == "project" and not lab.shared_users.exists()


def test_the_owner_shares_a_session_from_its_job_page(demo, lab):
    """The job page lists the job's sessions; its owner's cards carry the same form, which returns
    to the job page; bob (once it is shared with the project) sees the card without the form."""
    alice = browser(demo.users["alice"])
    url = reverse("session-share", args=[lab.pk])
    page = reverse("jobs:detail", args=[lab.job_id])
    html = alice.get(page).content.decode()
    assert "Interactive sessions" in html and "JupyterLab · lab" in html
    assert "Who may connect: only you." in html and f'hx-post="{url}"' in html
    assert '<input type="hidden" name="back" value="job">' in html

    token = alice.cookies["csrftoken"].value
    r = alice.post(url, {"share": "project", "users": "charlie", "back": "job", "csrfmiddlewaretoken": token},
                   headers={"HX-Request": "true"})
    html = r.content.decode()
    assert r.status_code == 200 and "No user named &#x27;charlie&#x27;" in html
    assert '<input type="hidden" name="back" value="job">' in html  # a retry still returns to the job
    r = alice.post(url, {"share": "project", "users": "", "back": "job", "csrfmiddlewaretoken": token})
    assert r.status_code == 302 and r["Location"] == page
    lab.refresh_from_db()
    assert lab.share == "project"
    html = alice.get(page).content.decode()
    assert "Who may connect: everyone in vision." in html and "Sharing of lab (job" in html

    bob = browser(demo.users["bob"]).get(page)
    assert bob.status_code == 200
    assert "JupyterLab · lab" in bob.content.decode() and url not in bob.content.decode()
    assert "Shared with you by alice." in bob.content.decode()
    assert browser(demo.users["charlie"]).get(page).status_code == 404


def test_the_job_page_hides_sessions_not_shared(demo, lab):
    """A project member sees the job page, but not a session the owner keeps to themselves."""
    html = browser(demo.users["bob"]).get(reverse("jobs:detail", args=[lab.job_id])).content.decode()
    assert "JupyterLab · lab" not in html and reverse("session-share", args=[lab.pk]) not in html
