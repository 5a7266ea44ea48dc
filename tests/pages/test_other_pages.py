"""Dashboard, project, tokens and nodes pages through the test client."""
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.jobs.services import template_save
from portal.jobs.states import transition
from portal.nodes.models import Node
from portal.nodes.services import node_add
from portal.tenancy.models import Membership, Quota
from tests.conftest import make_token


def csrf_of(page: str) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)


# Dashboard


def test_dashboard_lists_my_active_and_finished_jobs(demo, browser, submit):
    running, done, bobs = submit(name="live-one"), submit(name="done-one"), submit(user="bob", name="bobs-job")
    transition(done.pk, to="succeeded", from_states={"queued"})
    page = browser("alice").get("/").content.decode()
    assert "<title>Dashboard" in page
    active, finished = page.split('id="finished-h"')
    assert "live-one" in active and "done-one" in finished and "bobs-job" not in page


@pytest.mark.clock
def test_dashboard_quota_bars_warn_at_50_and_danger_at_80_percent(demo, browser, submit, clock):
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    # 5 GPUs for 17 h this month (less at the start of a month): 85% of the budget, danger.
    since = clock.ago_this_month(hours=17)
    used = round(5 * (clock() - since).total_seconds() / 3600, 1)  # the page shows tenths
    budget = Decimal(used / 0.85).quantize(Decimal("0.01"))
    Quota.objects.filter(project=demo.vision).update(max_gpus=Decimal(10), gpu_hours_budget=budget)
    job = submit()
    # Last month's GPU-hours do not count.
    Allocation.objects.create(job=job, attempt=1, gpu=node.gpus.get(index=7),
                              started_at=clock.month_start - timedelta(hours=90), released_at=clock.month_start)
    for gpu in list(node.gpus.all())[:5]:  # 5 of 10 GPUs: warning
        Allocation.objects.create(job=job, attempt=1, gpu=gpu, started_at=since)
    page = browser("alice").get("/").content.decode()
    assert 'class="bar warn"' in page and "5 of 10 max" in page
    assert 'class="bar danger"' in page and "budget nearly spent" in page
    assert f">{used:g} of " in page
    assert 'aria-label="GPUs in use: 5 of 10 (50%), guaranteed 8"' in page
    # charlie's dashboard shows only nlp.
    page = browser("charlie").get("/").content.decode()
    assert "vision" not in page and "nlp" in page


# Project page


def test_project_page_for_members_and_404_for_outsiders(demo, browser):
    template_save(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="py",
                  spec={"image": "gpuportal/python:3.11"}, locked=[])
    page = browser("dave").get("/projects/vision/").content.decode()
    assert "<title>Project vision" in page and "bob" in page and "py" in page
    assert "Add a member" not in page  # viewers do not manage
    assert "Add a member" in browser("alice").get("/projects/vision/").content.decode()
    assert browser("charlie").get("/projects/vision/").status_code == 404
    response = browser("charlie").post("/projects/vision/members/", {"username": "charlie", "role": "owner"})
    assert response.status_code == 404
    assert not Membership.objects.filter(project=demo.vision, user__username="charlie").exists()


def test_owner_adds_changes_and_removes_members(demo, browser):
    alice = browser("alice")
    assert alice.post("/projects/vision/members/", {"username": "charlie", "role": "viewer"}).status_code == 302
    assert Membership.objects.get(project=demo.vision, user__username="charlie").role == "viewer"
    assert alice.post("/projects/vision/members/charlie/role/", {"role": "member"}).status_code == 302
    assert Membership.objects.get(project=demo.vision, user__username="charlie").role == "member"
    assert alice.post("/projects/vision/members/charlie/remove/").status_code == 302
    assert not Membership.objects.filter(project=demo.vision, user__username="charlie").exists()


def test_member_form_errors_are_shown(demo, browser):
    page = browser("alice").post("/projects/vision/members/", {"username": "nobody", "role": "member"}).content.decode()
    assert re.search(r'id="id_username_error"><li>No active user named &#x27;nobody&#x27;', page)
    page = browser("alice").post("/projects/vision/members/", {"username": "bob", "role": "member"}).content.decode()
    assert "already a member" in page


def test_member_cannot_manage_members(demo, browser):
    response = browser("bob").post("/projects/vision/members/dave/role/", {"role": "owner"})
    assert response.status_code == 403 and "owner or admin role" in response.content.decode()
    assert Membership.objects.get(project=demo.vision, user__username="dave").role == "viewer"


def test_template_form(demo, browser):
    alice = browser("alice")
    page = alice.post("/projects/vision/templates/", {"name": "t", "spec": "{not json"}).content.decode()
    assert 'id="id_spec_error"' in page and "Not valid JSON" in page
    page = alice.post("/projects/vision/templates/",
                      {"name": "t", "spec": '{"resources": {"gpus": 99}}'}).content.decode()
    assert "exceeds the project limit" in page
    assert alice.post("/projects/vision/templates/", {"name": "t", "spec": '{"image": "gpuportal/busybox:latest"}',
                                                      "locked": "image"}).status_code == 302
    assert demo.vision.job_templates.get().locked == ["image"]


# Tokens page


def test_token_create_shows_the_secret_once(demo, browser):
    client = browser("alice")
    response = client.post("/tokens/", {"name": "laptop", "scopes": ["read", "submit"], "project": "",
                                        "expires_days": 30})
    page = response.content.decode()
    secret = re.search(r'id="token-secret" class="secret" value="(gpp_[A-Za-z0-9]+)"', page).group(1)
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    token = ApiToken.objects.get(user__username="alice")
    assert token.name == "laptop" and token.scopes == ["read", "submit"] and secret.startswith(token.prefix)
    assert 'data-copy="#token-secret"' in page
    assert secret not in client.get("/tokens/").content.decode()  # never again


def test_token_form_errors(demo, browser):
    page = browser("alice").post("/tokens/", {"name": "", "expires_days": 0}).content.decode()
    assert 'id="id_name_error"' in page and 'id="id_scopes_error"' in page and 'id="id_expires_days_error"' in page
    assert not ApiToken.objects.exists()


def test_tokens_are_personal_and_revoke_needs_csrf(demo, browser):
    make_token(demo.users["alice"], ["read"])
    token = ApiToken.objects.get()
    bobs_list = browser("bob").get("/tokens/").content.decode().split("Your tokens")[1].split("Create a token")[0]
    assert "No tokens yet." in bobs_list and "test" not in bobs_list
    assert browser("bob").post(f"/tokens/{token.pk}/revoke/").status_code == 404
    client = browser("alice", csrf=True)
    assert client.post(f"/tokens/{token.pk}/revoke/").status_code == 403
    token.refresh_from_db()
    assert token.revoked_at is None
    page = client.get("/tokens/").content.decode()
    assert client.post(f"/tokens/{token.pk}/revoke/", {"csrfmiddlewaretoken": csrf_of(page)}).status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert "revoked" in client.get("/tokens/").content.decode()


# Nodes page


@pytest.mark.parametrize("who", ["alice", "bob", "dave", "charlie"])
def test_nodes_page_is_staff_only(demo, browser, who):
    assert browser(who).get("/nodes/").status_code == 403


@pytest.mark.clock
def test_nodes_page_shows_gpus_and_what_runs_where(demo, browser, submit, clock):
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=7))
    job = submit()
    Allocation.objects.create(job=job, attempt=1, gpu=node.gpus.get(index=0), started_at=timezone.now())
    page = browser("admin").get("/nodes/").content.decode()
    assert "<title>Nodes" in page and "H100-80GB" in page and f"job {job.pk}" in page and "vision/alice" in page
    assert re.search(r"\b7 s ago", page)  # the clock is pinned: exactly 7 s
    assert "Drain gpu-01" in page


def test_drain_and_undrain_need_staff_and_csrf(demo, browser):
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    assert browser("alice").post("/nodes/gpu-01/drain/").status_code == 403
    client = browser("admin", csrf=True)
    assert client.post("/nodes/gpu-01/drain/").status_code == 403  # no CSRF token
    node.refresh_from_db()
    assert node.state == "ready"
    token = csrf_of(client.get("/nodes/").content.decode())
    response = client.post("/nodes/gpu-01/drain/", {"csrfmiddlewaretoken": token, "reason": "maintenance"})
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.state == "drained" and node.state_reason == "maintenance"
    assert "Undrain gpu-01" in client.get("/nodes/").content.decode()
    assert client.post("/nodes/gpu-01/undrain/", {"csrfmiddlewaretoken": token}).status_code == 302
    node.refresh_from_db()
    assert node.state == "ready"
