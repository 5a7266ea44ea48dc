"""A token restricted to one project changes nothing elsewhere (issue 12, H2 and the write audit).

Every write the URL conf accepts (POST, PUT, PATCH, DELETE on every named URL) is sent with
tokens holding every scope but restricted to project "audio", at vision's objects, by alice
(owner of both projects) and by staff: each must be refused and write nothing. The writes
come from the isolation matrix's rows, and `test_every_write_is_audited` fails when a view
accepts a write method that has no row there, so a new endpoint cannot slip past.
"""
import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from portal.core.context import Actor
from portal.core.models import AuditEvent
from tests.conftest import make_token
from tests.core.test_isolation_matrix import COVERED_BY_PREFIX, MATRIX, _alice_token, _tenant_objects

WRITE_METHODS = ("post", "put", "patch", "delete")
# Writes no token can reach by design, with why.
EXEMPT = {
    ("login", "POST"): "signs in with a password; pages ignore Bearer tokens",
    ("login", "PUT"): "Django's FormView treats PUT as POST: the same sign-in",
}


def _write_methods(callback) -> set[str]:
    actions = getattr(callback, "actions", None)  # a DRF viewset route: {method: action}
    if actions is not None:
        return {m for m in actions if m in WRITE_METHODS}
    cls = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    if cls is None:
        return set(WRITE_METHODS)  # a function view: assume it writes until a row says otherwise
    return {m for m in WRITE_METHODS if m in cls.http_method_names and hasattr(cls, m)}


def _writes(resolver=None, namespace=""):
    resolver = resolver or get_resolver()
    for item in resolver.url_patterns:
        if isinstance(item, URLResolver):
            yield from _writes(item, f"{namespace}{item.namespace}:" if item.namespace else namespace)
        elif isinstance(item, URLPattern) and item.name:
            for method in _write_methods(item.callback):
                yield f"{namespace}{item.name}", method.upper()


def test_every_write_is_audited():
    missing = sorted(
        (name, method) for name, method in set(_writes())
        if not any(name.startswith(p) for p in COVERED_BY_PREFIX) and (name, method) not in EXEMPT
        and not any(row["method"] == method for row in MATRIX.get(name, []))
    )
    assert not missing, f"write endpoints without an isolation-matrix row: {missing}"


WRITE_ROWS = [(name, i) for name, rows in MATRIX.items() for i, row in enumerate(rows) if row["method"] != "GET"]


@pytest.fixture
def audio(demo):
    """A second project of acme's where alice is an owner too."""
    from portal.tenancy.models import Organization
    from portal.tenancy.services import membership_add, project_create

    staff = Actor(user=demo.users["admin"])
    project = project_create(actor=staff, organization=Organization.objects.get(slug="acme"), slug="audio",
                             name="Audio")
    membership_add(actor=staff, project=project, username="alice", role="owner")
    return project


@pytest.mark.parametrize("username", ["alice", "admin"])
@pytest.mark.parametrize("name,index", WRITE_ROWS, ids=[f"{n}[{MATRIX[n][i]['method']}]" for n, i in WRITE_ROWS])
def test_restricted_token_writes_nothing_outside_its_project(demo, api, audio, name, index, username):
    row = MATRIX[name][index]
    fixtures = _tenant_objects(demo)
    alice_token = _alice_token(demo.users["alice"]).pk
    token = make_token(demo.users[username], ["read", "submit", "admin"], project=audio)
    before = AuditEvent.objects.count()
    url = row["url"].format(alice_token=alice_token, **fixtures)
    response = getattr(api(token=token), row["method"].lower())(url, data=row["body"], format="json")
    if row["api"]:
        assert 400 <= response.status_code < 500, (response.status_code, response.content[:300])
        assert response.status_code != 401 or name.startswith("agent:")  # refused for the restriction, not the token
    else:
        assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert AuditEvent.objects.count() == before, list(AuditEvent.objects.values_list("action", flat=True)[:3])


def test_restricted_token_cannot_create_a_template_in_another_project(demo, api, audio):
    """H2: the template serializer's project choices ignored the restriction."""
    from portal.jobs.models import JobTemplate

    token = make_token(demo.users["alice"], ["read", "submit", "admin"], project=audio)
    body = {"project": "vision", "name": "leak", "spec": {"image": "gpuportal/busybox:latest"}}
    response = api(token=token).post("/api/v1/job-templates/", body, format="json")
    assert response.status_code == 400
    assert "project" in response.json()["error"]["fields"]
    assert not JobTemplate.objects.filter(name="leak").exists()
    # Inside its own project the same token may.
    response = api(token=token).post("/api/v1/job-templates/", {**body, "project": "audio"}, format="json")
    assert response.status_code == 201, response.json()


def test_restricted_token_cannot_name_another_project_for_a_new_token(demo, api, audio):
    token = make_token(demo.users["alice"], ["read", "submit", "admin"], project=audio)
    response = api(token=token).post("/api/v1/tokens/", {"name": "x", "scopes": ["read"], "project": "vision"},
                                     format="json")
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {"project": ["No project named 'vision'."]}


def test_restricted_token_may_still_write_inside_its_project(demo, api, audio):
    """The refusal is about the restriction, not about writes: the same calls inside audio work."""
    token = make_token(demo.users["alice"], ["read", "submit", "admin"], project=audio)
    client = api(token=token)
    assert client.patch("/api/v1/projects/audio/", {"description": "d"}, format="json").status_code == 200
    assert client.post("/api/v1/projects/audio/members/", {"username": "bob", "role": "viewer"},
                       format="json").status_code == 201
    response = client.post("/api/v1/tokens/", {"name": "x", "scopes": ["read"], "project": "audio"}, format="json")
    assert response.status_code == 201, response.json()


def test_services_refuse_a_token_restricted_to_another_project(demo, audio):
    """Defence in depth: the services check the restriction themselves, whatever view calls them."""
    from portal.accounts.models import ApiToken
    from portal.core.errors import InvalidInput, NotFound
    from portal.jobs.services import job_cancel, job_submit, template_delete, template_save
    from portal.tenancy.models import Membership
    from portal.tenancy.services import (membership_add, membership_change_role, membership_remove, project_update,
                                         quota_update)

    fixtures = _tenant_objects(demo)
    from portal.jobs.models import Job, JobTemplate

    job, template = Job.objects.get(pk=fixtures["vision_job"]), JobTemplate.objects.get(pk=fixtures["vision_template"])
    make_token(demo.users["alice"], ["read", "submit", "admin"], project=audio)
    alice = Actor(user=demo.users["alice"], token=ApiToken.objects.filter(user=demo.users["alice"]).latest("id"))
    make_token(demo.users["admin"], ["read", "submit", "admin"], project=audio)
    staff = Actor(user=demo.users["admin"], token=ApiToken.objects.filter(user=demo.users["admin"]).latest("id"))
    dave = Membership.objects.get(project=demo.vision, user__username="dave")
    calls = [
        lambda: template_save(actor=alice, project=demo.vision, name="x", spec={}, locked=[]),
        lambda: template_delete(actor=alice, template=template),
        lambda: job_cancel(actor=alice, job=job),
        lambda: project_update(actor=alice, project=demo.vision, description="x"),
        lambda: membership_add(actor=alice, project=demo.vision, username="charlie", role="viewer"),
        lambda: membership_change_role(actor=alice, membership=dave, role="member"),
        lambda: membership_remove(actor=alice, membership=dave),
        lambda: quota_update(actor=staff, project=demo.vision, max_running_jobs=1),
    ]
    before = AuditEvent.objects.count()
    for call in calls:
        with pytest.raises(NotFound):
            call()
    with pytest.raises(InvalidInput, match="No project named 'vision'"):
        job_submit(actor=alice, data={"project": "vision", "name": "x", "image": "gpuportal/busybox:latest",
                                      "command": ["true"]})
    assert AuditEvent.objects.count() == before
