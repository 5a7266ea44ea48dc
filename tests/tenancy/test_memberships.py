"""Members of a project over the API (portal.tenancy.services): who may add, change and remove
whom, the last-owner rule, and access that follows membership at once."""
import pytest

from portal.core.models import AuditEvent
from portal.tenancy.models import Membership

from tests.conftest import submit

MEMBERS = "/api/v1/projects/vision/members/"


def member(username):
    return f"{MEMBERS}{username}/"


def test_a_member_added_sees_the_projects_jobs_and_loses_them_when_removed(demo, api):
    job = submit(demo)  # alice's job in vision
    charlie = api("charlie")
    assert charlie.get(f"/api/v1/jobs/{job.pk}/").status_code == 404
    r = api("alice").post(MEMBERS, {"username": "charlie", "role": "viewer"}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["role"] == "viewer"
    assert charlie.get(f"/api/v1/jobs/{job.pk}/").status_code == 200
    assert charlie.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 403  # a viewer cancels nothing
    assert api("alice").delete(member("charlie")).status_code == 204
    assert charlie.get(f"/api/v1/jobs/{job.pk}/").status_code == 404
    assert charlie.get(MEMBERS).status_code == 404
    actions = list(AuditEvent.objects.filter(action__startswith="membership.", project=demo.vision)
                   .order_by("pk").values_list("action", flat=True))
    assert actions[-2:] == ["membership.create", "membership.delete"]


@pytest.mark.parametrize("who, status", [("bob", 403), ("dave", 403), ("charlie", 404), ("anonymous", 401)])
def test_only_owners_and_admins_manage_members(demo, api, who, status):
    client = api(None if who == "anonymous" else who)
    other = "bob" if who == "dave" else "dave"  # leaving on one's own is allowed (below)
    assert client.post(MEMBERS, {"username": "charlie", "role": "member"}, format="json").status_code == status
    assert client.patch(member(other), {"role": "admin"}, format="json").status_code == status
    assert client.delete(member(other)).status_code == status
    assert dict(Membership.objects.filter(project=demo.vision).values_list("user__username", "role")) == {
        "alice": "owner", "bob": "member", "dave": "viewer"}
    assert not Membership.objects.filter(project=demo.vision, user__username="charlie").exists()


def test_an_admin_manages_members_but_not_owners(demo, api):
    assert api("alice").patch(member("bob"), {"role": "admin"}, format="json").status_code == 200
    bob = api("bob")
    assert bob.patch(member("dave"), {"role": "member"}, format="json").status_code == 200
    r = bob.post(MEMBERS, {"username": "charlie", "role": "owner"}, format="json")
    assert r.status_code == 403 and "owner" in r.json()["error"]["message"]
    assert bob.patch(member("alice"), {"role": "member"}, format="json").status_code == 403
    assert bob.delete(member("alice")).status_code == 403
    assert Membership.objects.get(project=demo.vision, user__username="alice").role == "owner"


def test_a_project_keeps_at_least_one_owner(demo, api):
    alice = api("alice")
    r = alice.patch(member("alice"), {"role": "admin"}, format="json")
    assert r.status_code == 409 and r.json()["error"]["fields"] == {"role": ["A project must keep at least one owner."]}
    assert alice.delete(member("alice")).status_code == 409
    # With a second owner the first may step down, and then the second is the last.
    assert alice.patch(member("bob"), {"role": "owner"}, format="json").status_code == 200
    assert alice.patch(member("alice"), {"role": "member"}, format="json").status_code == 200
    assert api("bob").delete(member("bob")).status_code == 409


def test_a_member_may_leave_on_their_own(demo, api):
    assert api("dave").delete(member("dave")).status_code == 204
    assert api("dave").get(MEMBERS).status_code == 404


@pytest.mark.parametrize("body, field", [
    ({"username": "nobody", "role": "member"}, "username"),
    ({"username": "charlie", "role": "emperor"}, "role"),
    ({"username": "bob", "role": "member"}, "username"),  # already a member: 409
    ({"username": "charlie"}, "role"),
])
def test_bad_member_requests_name_the_field(demo, api, body, field):
    r = api("alice").post(MEMBERS, body, format="json")
    assert r.status_code in (400, 409), r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert Membership.objects.filter(project=demo.vision).count() == 3
