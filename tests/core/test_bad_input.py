"""Bad input gets a 4xx with a field-level message, never a 500, never a partial record."""
import json

import pytest

from portal.accounts.models import ApiToken
from portal.core.models import AuditEvent
from portal.tenancy.models import Membership, Organization, Project, Quota


def counts():
    return (Organization.objects.count(), Project.objects.count(), Quota.objects.count(),
            Membership.objects.count(), ApiToken.objects.count())


def error(response):
    body = response.json()["error"]
    assert set(body) == {"status", "code", "message", "fields"}
    assert body["status"] == response.status_code
    return body


@pytest.fixture
def admin(demo, api):
    return api("admin")


def test_malformed_json(admin, demo):
    before = counts()
    r = admin.post("/api/v1/projects/", data='{"organization": "acme", "slug": ', content_type="application/json")
    assert r.status_code == 400
    assert "Malformed JSON" in error(r)["message"]
    assert counts() == before


def test_nan_is_not_json(admin):
    r = admin.patch("/api/v1/projects/vision/quota/", data='{"max_gpus": NaN}', content_type="application/json")
    assert r.status_code == 400


def test_non_json_content_type_is_refused(admin):
    r = admin.post("/api/v1/organizations/", data="slug=x&name=y", content_type="application/x-www-form-urlencoded")
    assert r.status_code == 415
    assert error(r)["code"] == "unsupported_media_type"


@pytest.mark.parametrize("body,field", [
    ({"slug": 5, "name": "x"}, "slug"),
    ({"slug": ["a"], "name": "x"}, "slug"),
    ({"slug": "ok-org", "name": "x", "max_gpus": "many"}, "max_gpus"),
    ({"slug": "ok-org", "name": "x", "max_gpus": -1}, "max_gpus"),
    ({"slug": "ok-org", "name": "x", "colour": "red"}, "colour"),
    ({"slug": "ok-org", "name": "x", "created_at": "2020-01-01T00:00:00Z"}, "created_at"),
    ({"slug": "a" * 10000, "name": "x"}, "slug"),
    ({"slug": "ok-org", "name": "n" * 10000}, "name"),
    ({"slug": "ok-org", "name": "nul\x00byte"}, "name"),
    ({"slug": "Ünïcode", "name": "x"}, "slug"),
    ({"slug": "acme", "name": "dup"}, "slug"),
    ({"slug": "-bad-", "name": "x"}, "slug"),
])
def test_organization_create_rejects_with_field_message(admin, body, field):
    before = counts()
    r = admin.post("/api/v1/organizations/", data=body, format="json")
    assert r.status_code == 400, r.content
    body = error(r)
    assert field in body["fields"], body
    assert counts() == before


def test_top_level_must_be_an_object(admin):
    r = admin.post("/api/v1/organizations/", data=json.dumps([1, 2]), content_type="application/json")
    assert r.status_code == 400


def test_oversized_body(admin, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    before = counts()
    r = admin.post("/api/v1/organizations/", data={"slug": "big", "name": "x" * 20_000}, format="json")
    assert r.status_code == 413
    assert error(r)["code"] == "payload_too_large"
    assert counts() == before


def test_odd_unicode_in_free_text_is_kept(admin):
    # Any script and emoji; control and format characters (a right-to-left override) are refused
    # in names (tests/jobs/test_submit.py).
    name = "Проект 🚀 עברית"
    r = admin.patch("/api/v1/projects/vision/", data={"name": name}, format="json")
    assert r.status_code == 200
    assert Project.objects.get(slug="vision").name == name


def test_duplicate_project_slug_leaves_nothing(admin):
    before = counts()
    r = admin.post("/api/v1/projects/", data={"organization": "globex", "slug": "vision", "name": "dup"}, format="json")
    assert r.status_code == 400
    assert "slug" in error(r)["fields"]
    assert counts() == before


def test_project_create_with_bad_quota_leaves_nothing(admin):
    before = counts()
    r = admin.post("/api/v1/projects/", data={"organization": "acme", "slug": "newp", "name": "N",
                                              "quota": {"max_gpus": "lots"}}, format="json")
    assert r.status_code == 400
    assert "quota.max_gpus" in error(r)["fields"]
    assert counts() == before


def test_project_create_unknown_organization(admin):
    r = admin.post("/api/v1/projects/", data={"organization": "nope", "slug": "newp", "name": "N"}, format="json")
    assert r.status_code == 400
    assert "organization" in error(r)["fields"]


@pytest.mark.parametrize("body,field", [
    ({"organization": "globex"}, "organization"),
    ({"id": 99}, "id"),
    ({"slug": "stolen"}, "slug"),
    ({"quota": {"max_gpus": 1000}}, "quota"),
    ({"role": "owner"}, "role"),
])
def test_mass_assignment_is_refused(demo, api, body, field):
    r = api("alice").patch("/api/v1/projects/vision/", data=body, format="json")
    assert r.status_code == 400
    assert field in error(r)["fields"]
    project = Project.objects.get(pk=demo.vision.pk)
    assert project.organization.slug == "acme" and project.slug == "vision"
    assert project.quota.max_gpus == 16


def test_member_cannot_make_itself_owner(demo, api):
    r = api("bob").patch("/api/v1/projects/vision/members/bob/", data={"role": "owner"}, format="json")
    assert r.status_code == 403
    assert Membership.objects.get(project=demo.vision, user__username="bob").role == "member"


def test_admin_cannot_grant_owner(demo, api):
    from portal.core.context import Actor
    from portal.tenancy.services import membership_change_role

    bob = Membership.objects.get(project=demo.vision, user__username="bob")
    membership_change_role(actor=Actor(user=demo.users["alice"]), membership=bob, role="admin")
    r = api("bob").patch("/api/v1/projects/vision/members/bob/", data={"role": "owner"}, format="json")
    assert r.status_code == 403
    assert error(r)["fields"] == {"role": ["Only an owner can grant or change the owner role."]}
    r = api("bob").patch("/api/v1/projects/vision/members/alice/", data={"role": "viewer"}, format="json")
    assert r.status_code == 403
    r = api("bob").post("/api/v1/projects/vision/members/", data={"username": "charlie", "role": "owner"}, format="json")
    assert r.status_code == 403
    assert not Membership.objects.filter(project=demo.vision, user__username="charlie").exists()
    # An admin does manage non-owner roles.
    r = api("bob").patch("/api/v1/projects/vision/members/dave/", data={"role": "member"}, format="json")
    assert r.status_code == 200


def test_last_owner_cannot_leave_or_be_demoted(demo, api):
    r = api("alice").patch("/api/v1/projects/vision/members/alice/", data={"role": "member"}, format="json")
    assert r.status_code == 409
    r = api("alice").delete("/api/v1/projects/vision/members/alice/")
    assert r.status_code == 409
    assert Membership.objects.get(project=demo.vision, user__username="alice").role == "owner"


@pytest.mark.parametrize("body,field,status", [
    ({"username": "nobody", "role": "member"}, "username", 400),
    ({"username": "charlie", "role": "god"}, "role", 400),
    ({"username": "bob", "role": "member"}, "username", 409),
    ({"username": "charlie"}, "role", 400),
])
def test_member_add_errors(demo, api, body, field, status):
    before = counts()
    r = api("alice").post("/api/v1/projects/vision/members/", data=body, format="json")
    assert r.status_code == status
    assert field in error(r)["fields"]
    assert counts() == before


@pytest.mark.parametrize("body,field", [
    ({"name": "t", "scopes": ["root"]}, "scopes.0"),
    ({"name": "t", "scopes": []}, "scopes"),
    ({"name": "t", "expires_days": 0}, "expires_days"),
    ({"name": "t", "expires_days": 400}, "expires_days"),
    ({"name": "t", "project": "nlp"}, "project"),
    ({"name": "t", "digest": "abc"}, "digest"),
    ({"name": "t", "user": 1}, "user"),
    ({}, "name"),
])
def test_token_create_errors(demo, api, body, field):
    before = counts()
    r = api("alice").post("/api/v1/tokens/", data=body, format="json")
    assert r.status_code == 400, r.content
    assert field in error(r)["fields"], error(r)
    assert counts() == before


def test_quota_max_below_guaranteed(admin):
    r = admin.patch("/api/v1/projects/vision/quota/", data={"max_gpus": 2}, format="json")
    assert r.status_code == 400
    assert "max_gpus" in error(r)["fields"]
    assert Quota.objects.get(project__slug="vision").max_gpus == 16


def test_audit_records_every_change(demo, api):
    client = api("alice")
    start = AuditEvent.objects.latest("id").id
    assert client.patch("/api/v1/projects/vision/", data={"description": "d"}, format="json").status_code == 200
    assert client.patch("/api/v1/projects/vision/members/dave/", data={"role": "member"}, format="json").status_code == 200
    r = client.post("/api/v1/tokens/", data={"name": "t"}, format="json", REMOTE_ADDR="10.1.2.3")
    assert client.delete(f"/api/v1/tokens/{r.json()['id']}/").status_code == 204
    events = list(AuditEvent.objects.filter(id__gt=start).order_by("id"))
    assert [ev.action for ev in events] == ["project.update", "membership.update", "token.create", "token.revoke"]
    assert all(ev.actor_label == "alice" for ev in events)
    assert events[2].source_ip == "10.1.2.3"
    # A failed change writes no audit row.
    assert client.patch("/api/v1/projects/vision/members/alice/", data={"role": "viewer"}, format="json").status_code == 409
    assert AuditEvent.objects.filter(id__gt=start).count() == 4


def test_audit_names_the_token(demo, api):
    from tests.conftest import make_token

    token = make_token(demo.users["alice"], ["read", "admin"])
    r = api(token=token).patch("/api/v1/projects/vision/", data={"description": "via token"}, format="json")
    assert r.status_code == 200
    event = AuditEvent.objects.filter(action="project.update").latest("id")
    assert event.token_prefix == token[:12]


# Malformed input that used to reach the database or the interpreter's stack (a 500 with
# nothing written): refused up front, the same way on every endpoint.

JSON_ENDPOINTS = ["/api/v1/organizations/", "/api/v1/projects/", "/api/v1/jobs/", "/api/v1/tokens/",
                  "/api/v1/job-templates/", "/api/v1/projects/vision/members/"]


@pytest.mark.parametrize("url", JSON_ENDPOINTS)
@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_refused(admin, url, depth):
    before = counts()
    r = admin.post(url, data='{"name": ' + "[" * depth + "]" * depth + "}", content_type="application/json")
    assert r.status_code == 400, r.content
    assert "nested deeper than" in error(r)["message"]
    assert counts() == before


def test_deeply_nested_json_is_refused_on_the_agent_api(demo):
    from rest_framework.test import APIClient

    from portal.core.context import Actor
    from portal.nodes.services import node_add

    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-09", gpus="1xH100-80GB")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    r = client.post("/api/agent/v1/heartbeat", data='{"samples": ' + "[" * 50_000 + "]" * 50_000 + "}",
                    content_type="application/json")
    assert r.status_code == 400 and "nested deeper than" in error(r)["message"]


@pytest.mark.parametrize("raw", ['{"name": "\\ud800"}', '{"\\udfff": "x"}', '{"name": 1e400}'])
def test_text_that_is_not_unicode_and_infinite_numbers_are_refused(admin, raw):
    r = admin.patch("/api/v1/projects/vision/", data=raw, content_type="application/json")
    assert r.status_code == 400, r.content
    assert error(r)["message"].startswith("Malformed JSON")
    assert Project.objects.get(slug="vision").name != "\ud800"


@pytest.mark.parametrize("url", [
    "/api/v1/projects/vi%00sion/", "/api/v1/organizations/ac%00me/", "/api/v1/projects/vision/members/b%00ob/",
    "/api/v1/nodes/gpu%00/", "/api/v1/jobs/1%00/", "/nodes/a%00/drain/", "/projects/vision/members/b%00ob/role/",
    "/api/agent/v1/jobs/1%00/confirm",
])
@pytest.mark.parametrize("method", ["get", "post", "patch", "delete"])
def test_nul_in_a_url_is_404(admin, url, method):
    before = counts()
    r = getattr(admin, method)(url, data={}, format="json")
    assert r.status_code == 404, (r.status_code, r.content[:300])
    if url.startswith("/api/"):
        assert error(r)["code"] == "not_found"
    assert counts() == before


@pytest.mark.parametrize("url,field", [
    ("/api/v1/jobs/?state=%00", "state"), ("/api/v1/jobs/?project=vi%00sion", "project"),
    ("/api/v1/nodes/?pool=%00", "pool"), ("/api/v1/usage/?project=%00", "project"),
    ("/api/v1/jobs/?st%00ate=x", "st\\x00ate"),
])
def test_nul_in_a_query_is_400_naming_it(admin, url, field):
    r = admin.get(url)
    assert r.status_code == 400, r.content[:300]
    assert field in error(r)["fields"]


def test_nul_in_a_page_query_or_header_is_400(demo, api):
    assert api("alice").get("/jobs/?state=%00").status_code == 400
    r = api("alice").post("/api/v1/jobs/", data={}, format="json", HTTP_IDEMPOTENCY_KEY="k\x00")
    assert r.status_code == 400 and "idempotency-key" in error(r)["fields"]


@pytest.mark.parametrize("raw", ["²", "١", "1²", "-1", " 7", "99999999999999999999999"])
def test_odd_digits_in_page_ids_are_refused_not_500(demo, api, raw):
    from portal.jobs.models import Job

    client = api("alice")
    assert client.get(f"/jobs/new/?template={raw}").status_code == 404
    before = Job.objects.filter(state="cancelled").count()
    r = client.post("/jobs/cancel/", {"ids": [raw], "confirm": "yes"})
    assert r.status_code == 302  # back to the list with "select at least one job"
    assert Job.objects.filter(state="cancelled").count() == before
    r = client.post("/jobs/new/", {"project": "vision", "name": "j", "image": "gpuportal/busybox:latest",
                                   "command": "true", "depends_on": raw.strip()})
    assert r.status_code in (200, 400) and (b"is not a job id" in r.content or raw == " 7")


@pytest.mark.parametrize("when,status", [
    ("1850-07-06T19:52:59%2B23:27", 200),  # Python takes this offset, PostgreSQL does not: applied first
    ("2026-01-01T00:00:00-23:59", 200),
    ("0001-01-01T00:00:00%2B01:00", 400),  # before the year 1 once in UTC
    ("9999-12-31T23:59:59-01:00", 400),
])
def test_times_in_query_filters_are_taken_as_utc(admin, when, status):
    r = admin.get(f"/api/v1/jobs/?submitted_before={when}")
    assert r.status_code == status, r.content[:300]
    if status == 400:
        assert "submitted_before" in error(r)["fields"]


@pytest.mark.parametrize("url,body,field", [
    ("/api/v1/jobs/", {"project": "vis\x00ion", "name": "j", "image": "gpuportal/busybox:latest",
                       "command": ["true"]}, "project"),
    ("/api/v1/jobs/", {"project": "vision", "name": "j", "image": "gpuportal/busybox:latest",
                       "command": ["true"], "env": {"A\x00": "x"}}, "env"),
    ("/api/v1/job-templates/", {"project": "\x00", "name": "t", "spec": {}}, "project"),
    ("/api/v1/job-templates/", {"project": "vision", "name": "t", "spec": {"env": {"\x00": "1"}}}, "spec"),
    ("/api/v1/projects/vision/members/", {"username": "char\x00lie", "role": "member"}, "username"),
])
def test_nul_in_a_lookup_or_json_value_is_400(demo, api, url, body, field):
    from portal.jobs.models import Job, JobTemplate

    before = (counts(), Job.objects.count(), JobTemplate.objects.count())
    r = api("alice").post(url, data=body, format="json")
    assert r.status_code == 400, r.content[:300]
    assert field in error(r)["fields"], error(r)
    assert (counts(), Job.objects.count(), JobTemplate.objects.count()) == before
