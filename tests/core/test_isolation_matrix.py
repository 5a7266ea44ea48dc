"""Tenant-isolation matrix generated from the URL patterns.

Every named URL must have an entry in MATRIX (a new endpoint without one fails
`test_every_url_has_an_entry`). Each entry gives, per session persona, the
status the request must get; token personas are derived: a token acts as its
user, limited by its scopes (403 when the scope is missing) and its project.
"""
import io

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from tests.conftest import make_token

SESSION_PERSONAS = ["anonymous", "alice", "bob", "dave", "charlie", "admin"]
# name -> (user, scopes, restricted to vision?)
TOKEN_PERSONAS = {
    "alice_read": ("alice", ["read"], False),
    "alice_submit": ("alice", ["submit"], False),
    "alice_all": ("alice", ["read", "submit", "admin"], False),
    "alice_vision_read": ("alice", ["read"], True),
    "bob_all": ("bob", ["read", "submit", "admin"], False),
    "charlie_all": ("charlie", ["read", "submit", "admin"], False),
}

# Prefixes whose URLs are covered by a representative entry (Django admin has hundreds).
COVERED_BY_PREFIX = {"admin:": "admin:index"}


def e(method, url, expect, *, scope=None, body=None, api=True):
    """One matrix row. expect: {persona: status}; a missing insider persona uses 'default'."""
    return {"method": method, "url": url, "expect": expect, "scope": scope or ("read" if method == "GET" else "admin"),
            "body": body, "api": api}


def roles(anonymous, alice, bob, dave, charlie, admin):
    return dict(anonymous=anonymous, alice=alice, bob=bob, dave=dave, charlie=charlie, admin=admin)


ALL_200 = roles(401, 200, 200, 200, 200, 200)
NOBODY = {**roles(401, 401, 401, 401, 401, 401), **{t: 401 for t in TOKEN_PERSONAS}}
VISION_READ = roles(401, 200, 200, 200, 404, 200)
# Pages: anonymous visitors are sent to the login page; Bearer tokens count as anonymous there.
PAGE_ALL = roles(302, 200, 200, 200, 200, 200)
PAGE_VISION = roles(302, 200, 200, 200, 404, 200)
STAFF_PAGE = roles(302, 403, 403, 403, 403, 200)


def page(method, url, expect):
    return e(method, url, expect, api=False)

MATRIX = {
    "api:me": [e("GET", "/api/v1/me/", ALL_200)],
    # Personal settings: everyone reads and changes only their own (there is no other URL).
    "api:me-notifications": [e("GET", "/api/v1/me/notifications/", ALL_200),
                             e("PATCH", "/api/v1/me/notifications/", ALL_200, body={"job_succeeded": True})],
    "api:organization-list": [
        e("GET", "/api/v1/organizations/", ALL_200),
        e("POST", "/api/v1/organizations/", roles(401, 403, 403, 403, 403, 201), body={"slug": "initech", "name": "Initech"}),
    ],
    "api:organization-detail": [e("GET", "/api/v1/organizations/acme/", VISION_READ)],
    "api:project-list": [
        e("GET", "/api/v1/projects/", ALL_200),
        e("POST", "/api/v1/projects/", roles(401, 403, 403, 403, 403, 201),
          body={"organization": "acme", "slug": "robotics", "name": "Robotics"}),
    ],
    "api:project-detail": [
        e("GET", "/api/v1/projects/vision/", VISION_READ),
        e("PATCH", "/api/v1/projects/vision/", roles(401, 200, 403, 403, 404, 200), body={"description": "x"}),
    ],
    "api:project-quota": [
        e("GET", "/api/v1/projects/vision/quota/", VISION_READ),
        e("PATCH", "/api/v1/projects/vision/quota/", roles(401, 403, 403, 403, 404, 200), body={"max_running_jobs": 3}),
    ],
    "api:project-members": [
        e("GET", "/api/v1/projects/vision/members/", VISION_READ),
        e("POST", "/api/v1/projects/vision/members/", roles(401, 201, 403, 403, 404, 201),
          body={"username": "charlie", "role": "viewer"}),
    ],
    "api:project-member": [
        e("GET", "/api/v1/projects/vision/members/bob/", VISION_READ),
        e("PATCH", "/api/v1/projects/vision/members/dave/", roles(401, 200, 403, 403, 404, 200), body={"role": "member"}),
        # bob may leave on his own; dave (viewer) may not remove him.
        e("DELETE", "/api/v1/projects/vision/members/bob/", roles(401, 204, 204, 403, 404, 204)),
    ],
    "api:token-list": [
        e("GET", "/api/v1/tokens/", ALL_200),
        e("POST", "/api/v1/tokens/", roles(401, 201, 201, 201, 201, 201), body={"name": "ci", "scopes": ["read"]}),
    ],
    # {alice_token} is a token of alice's: tokens are personal, even staff get 404.
    "api:token-detail": [
        # A project-restricted token sees only tokens restricted to the same project.
        e("GET", "/api/v1/tokens/{alice_token}/", {**roles(401, 200, 404, 404, 404, 404), "alice_vision_read": 404}),
        e("DELETE", "/api/v1/tokens/{alice_token}/", roles(401, 204, 404, 404, 404, 404)),
    ],
    "api:job-list": [
        e("GET", "/api/v1/jobs/", ALL_200),
        e("POST", "/api/v1/jobs/", roles(401, 201, 201, 403, 400, 403), scope="submit", body={
            "project": "vision", "name": "m", "image": "gpuportal/busybox:latest", "command": ["true"]}),
    ],
    # A batch is submitted as one: the same answers as a single submit (docs/api.md "Batch submit").
    "api:job-batch": [e("POST", "/api/v1/jobs/batch/", roles(401, 201, 201, 403, 400, 403), scope="submit", body={
        "defaults": {"project": "vision", "image": "gpuportal/busybox:latest", "command": ["true"]},
        "jobs": [{"name": "b1"}, {"name": "b2"}]})],
    "api:job-detail": [e("GET", "/api/v1/jobs/{vision_job}/", VISION_READ),
                       # Update of alice's queued job (docs/jobs.md "Hold, release and update").
                       e("PATCH", "/api/v1/jobs/{vision_job}/", roles(401, 200, 403, 403, 404, 200),
                         scope="submit", body={"priority": "low"})],
    # The fixture job is alice's: bob (member) may cancel only his own jobs.
    "api:job-cancel": [e("POST", "/api/v1/jobs/{vision_job}/cancel/", roles(401, 202, 403, 403, 404, 202),
                         scope="submit")],
    "api:job-resubmit": [e("POST", "/api/v1/jobs/{vision_job}/resubmit/", roles(401, 201, 201, 403, 404, 403),
                           scope="submit")],
    "api:job-logs": [e("GET", "/api/v1/jobs/{vision_job}/logs/", VISION_READ)],
    # Artifacts are read through their job: who sees the job lists them; an id that is not the job's is 404.
    "api:job-artifact-list": [e("GET", "/api/v1/jobs/{vision_job}/artifacts/", VISION_READ)],
    "api:job-artifact-detail": [e("GET", "/api/v1/jobs/{vision_job}/artifacts/999999/",
                                  roles(401, 404, 404, 404, 404, 404))],
    # Hold, release, update: alice's queued job; bob (member) acts only on his own, staff on any.
    # Release of a job that is not held is a 409 for those allowed to try.
    "api:job-hold": [e("POST", "/api/v1/jobs/{vision_job}/hold/", roles(401, 200, 403, 403, 404, 200),
                       scope="submit")],
    "api:job-release": [e("POST", "/api/v1/jobs/{vision_job}/release/", roles(401, 409, 403, 403, 404, 409),
                          scope="submit")],
    # Move is for operators only: members get 403, outsiders 404; the fixture job is queued, so 409 for staff.
    "api:job-move": [e("POST", "/api/v1/jobs/{vision_job}/move/", roles(401, 403, 403, 403, 404, 409))],
    # Counts only: every signed-in user reads the cluster; accounting is scoped like usage.
    "api:cluster": [e("GET", "/api/v1/cluster/", ALL_200)],
    "api:usage-jobs": [e("GET", "/api/v1/usage/jobs/", ALL_200),
                       e("GET", "/api/v1/usage/jobs/?project=vision", VISION_READ)],
    # Volumes: everyone in the project reads, members upload, owners and admins create and delete.
    "api:volume-list": [
        e("GET", "/api/v1/volumes/", ALL_200),
        e("POST", "/api/v1/volumes/", roles(401, 201, 403, 403, 400, 201), body={"project": "vision", "name": "v2"}),
    ],
    "api:volume-detail": [
        e("GET", "/api/v1/volumes/{vision_volume}/", VISION_READ),
        e("DELETE", "/api/v1/volumes/{vision_volume}/", roles(401, 204, 403, 403, 404, 204)),
    ],
    "api:volume-files": [
        e("GET", "/api/v1/volumes/{vision_volume}/files/", VISION_READ),
        e("PUT", "/api/v1/volumes/{vision_volume}/files/?path=m.json", roles(401, 201, 201, 403, 404, 403),
          scope="submit", body={"x": 1}),
    ],
    "api:volume-download": [e("GET", "/api/v1/volumes/{vision_volume}/download/?path=f.txt", VISION_READ)],
    # Registry credentials: everyone in the project sees which registries have one (never the
    # secret); owners and admins set and delete them.
    "api:registry-credential-list": [
        e("GET", "/api/v1/registry-credentials/", ALL_200),
        e("POST", "/api/v1/registry-credentials/", roles(401, 201, 403, 403, 400, 201),
          body={"project": "vision", "registry": "registry.example.org", "username": "ci", "secret": "s3cret"}),
    ],
    "api:registry-credential-detail": [
        e("GET", "/api/v1/registry-credentials/{vision_registry_credential}/", VISION_READ),
        e("DELETE", "/api/v1/registry-credentials/{vision_registry_credential}/", roles(401, 204, 403, 403, 404, 204)),
    ],
    # Datasets: everyone in the project reads them, members add them and their versions, owners and
    # admins delete them; staff read and delete but add only where they are members.
    "api:dataset-list": [
        e("GET", "/api/v1/datasets/", ALL_200),
        e("POST", "/api/v1/datasets/", roles(401, 201, 201, 403, 400, 403), body={"project": "vision", "name": "d2"},
          scope="submit"),
    ],
    "api:dataset-detail": [
        e("GET", "/api/v1/datasets/{vision_dataset}/", VISION_READ),
        e("DELETE", "/api/v1/datasets/{vision_dataset}/", roles(401, 204, 403, 403, 404, 204)),
    ],
    "api:dataset-versions": [e("POST", "/api/v1/datasets/{vision_dataset}/versions/", roles(401, 201, 201, 403, 404, 403),
                               body={"source": {"kind": "http", "url": "http://127.0.0.1:9/set.tar"}}, scope="submit")],
    "api:dataset-upload": [e("PUT", "/api/v1/datasets/{vision_dataset}/upload/?filename=x.json",
                             roles(401, 201, 201, 403, 404, 403), body={"x": 1}, scope="submit")],
    "api:jobtemplate-list": [
        e("GET", "/api/v1/job-templates/", ALL_200),
        e("POST", "/api/v1/job-templates/", roles(401, 201, 403, 403, 400, 201),
          body={"project": "vision", "name": "t2", "spec": {"image": "gpuportal/busybox:latest"}}),
    ],
    "api:jobtemplate-detail": [
        e("GET", "/api/v1/job-templates/{vision_template}/", VISION_READ),
        e("PATCH", "/api/v1/job-templates/{vision_template}/", roles(401, 200, 403, 403, 404, 200),
          body={"description": "d"}),
        e("DELETE", "/api/v1/job-templates/{vision_template}/", roles(401, 204, 403, 403, 404, 204)),
    ],
    # Nodes are operator business: every tenant persona gets 403, staff 200.
    "api:node-list": [e("GET", "/api/v1/nodes/", roles(401, 403, 403, 403, 403, 200))],
    "api:node-detail": [e("GET", "/api/v1/nodes/gpu-01/", roles(401, 403, 403, 403, 403, 200))],
    "api:node-drain": [e("POST", "/api/v1/nodes/gpu-01/drain/", roles(401, 403, 403, 403, 403, 200))],
    "api:node-undrain": [e("POST", "/api/v1/nodes/gpu-01/undrain/", roles(401, 403, 403, 403, 403, 409))],
    # The agent API takes node tokens only: people and their tokens are strangers there.
    **{f"agent:{name}": [e("POST", f"/api/agent/v1/{path}", NOBODY, body={"attempt": 1})] for name, path in [
        ("register", "register"), ("heartbeat", "heartbeat"), ("confirm", "jobs/{vision_job}/confirm"),
        ("events", "jobs/{vision_job}/events"), ("logs", "jobs/{vision_job}/logs"), ("probe", "probe"),
        ("events-batch", "events"), ("confirms-batch", "confirms"),
        ("registry-auth", "jobs/{vision_job}/registry-auth"),
        ("progress", "jobs/{vision_job}/progress"), ("artifact-uploads", "jobs/{vision_job}/artifacts/uploads"),
        ("artifact-confirm", "jobs/{vision_job}/artifacts/confirm")]},
    "agent:dataset-file": [e("GET", "/api/agent/v1/datasets/" + "0" * 64 + "/file", NOBODY)],
    "agent:artifacts": [e("PUT", "/api/agent/v1/jobs/{vision_job}/artifacts?attempt=1&path=x", NOBODY, body={"x": 1})],
    "agent:sessions": [e("POST", "/api/agent/v1/jobs/{vision_job}/sessions", NOBODY,
                         body={"attempt": 1, "name": "lab", "state": "ended"})],
    # A session is its owner's (alice's) until she shares it: members, staff and outsiders see none.
    "api:session-list": [e("GET", "/api/v1/sessions/", ALL_200)],
    # The sharing form is the job owner's: members (even those it is shared with), staff and outsiders get 404.
    # An empty post is the form again with its field messages (200).
    "session-share": [page("GET", "/session-sharing/{vision_session}/", roles(302, 200, 404, 404, 404, 404)),
                      page("POST", "/session-sharing/{vision_session}/", roles(302, 200, 404, 404, 404, 404))],
    "api:session-detail": [
        e("GET", "/api/v1/sessions/{vision_session}/", roles(401, 200, 404, 404, 404, 404)),
        e("PATCH", "/api/v1/sessions/{vision_session}/", roles(401, 200, 404, 404, 404, 404), scope="submit",
          body={"share": "project"}),
    ],
    "schema": [e("GET", "/api/schema/", roles(200, 200, 200, 200, 200, 200), api=False)],
    "api-docs": [e("GET", "/api/docs/", roles(200, 200, 200, 200, 200, 200), api=False)],
    "login": [e("GET", "/login/", roles(200, 302, 302, 302, 302, 302), api=False)],
    "logout": [e("POST", "/logout/", roles(302, 302, 302, 302, 302, 302), api=False)],
    "home": [e("GET", "/", roles(302, 200, 200, 200, 200, 200), api=False)],
    # Browser pages (portal/*/views.py). The matrix posts JSON, which a page form reads as empty:
    # an empty form re-renders (200) and an empty bulk cancel goes back to the list (302).
    # A refused action is a 403 page; a done (or merely impossible) one redirects (302).
    "jobs:list": [page("GET", "/jobs/", PAGE_ALL)],
    "jobs:submit": [page("GET", "/jobs/new/", PAGE_ALL), page("POST", "/jobs/new/", PAGE_ALL)],
    "jobs:bulk-cancel": [page("POST", "/jobs/cancel/", roles(302, 302, 302, 302, 302, 302))],
    "jobs:detail": [page("GET", "/jobs/{vision_job}/", PAGE_VISION)],
    "jobs:status": [page("GET", "/jobs/{vision_job}/status/", PAGE_VISION)],
    "jobs:log": [page("GET", "/jobs/{vision_job}/log/", PAGE_VISION)],
    "job-metrics": [page("GET", "/jobs/{vision_job}/metrics/", PAGE_VISION)],
    # alice's job: bob (member) may not cancel it; staff may.
    "jobs:cancel": [page("POST", "/jobs/{vision_job}/cancel/", roles(302, 302, 403, 403, 404, 302))],
    # Staff submit only where they are members.
    "jobs:resubmit": [page("POST", "/jobs/{vision_job}/resubmit/", roles(302, 302, 302, 403, 404, 403))],
    "jobs:hold": [page("POST", "/jobs/{vision_job}/hold/", roles(302, 302, 403, 403, 404, 302))],
    "jobs:release": [page("POST", "/jobs/{vision_job}/release/", roles(302, 302, 403, 403, 404, 302))],
    "jobs:move": [page("POST", "/jobs/{vision_job}/move/", roles(302, 403, 403, 403, 404, 302))],
    "jobs:update": [page("POST", "/jobs/{vision_job}/update/", roles(302, 302, 403, 403, 404, 302))],
    "cluster": [page("GET", "/cluster/", PAGE_ALL)],
    "projects:detail": [page("GET", "/projects/vision/", PAGE_VISION)],
    # An empty form is a 400 before any role matters; the service refuses an empty upload (302 with the
    # message) to members and a viewer's or staff's (403).
    "volumes:list": [page("GET", "/projects/vision/volumes/", PAGE_VISION),
                     page("POST", "/projects/vision/volumes/", roles(302, 400, 400, 400, 404, 400))],
    "datasets:list": [page("GET", "/projects/vision/datasets/", PAGE_VISION)],
    "volumes:browse": [page("GET", "/projects/vision/volumes/{vision_volume}/", PAGE_VISION)],
    "volumes:download": [page("GET", "/projects/vision/volumes/{vision_volume}/download/?path=f.txt", PAGE_VISION)],
    "volumes:upload": [page("POST", "/projects/vision/volumes/{vision_volume}/upload/",
                            roles(302, 302, 302, 403, 404, 403))],
    "volumes:delete": [page("POST", "/projects/vision/volumes/{vision_volume}/delete/",
                            roles(302, 302, 403, 403, 404, 302))],
    "projects:member-add": [page("POST", "/projects/vision/members/", PAGE_VISION)],
    # An empty role is refused by the service with a message (302) for managers, 403 for the rest.
    "projects:member-role": [page("POST", "/projects/vision/members/dave/role/", roles(302, 302, 403, 403, 404, 302))],
    "projects:member-remove": [page("POST", "/projects/vision/members/bob/remove/", roles(302, 302, 302, 403, 404, 302))],
    "projects:template-add": [page("POST", "/projects/vision/templates/", PAGE_VISION)],
    "projects:template-delete": [page("POST", "/projects/vision/templates/{vision_template}/delete/",
                                      roles(302, 302, 403, 403, 404, 302))],
    "tokens:list": [page("GET", "/tokens/", PAGE_ALL), page("POST", "/tokens/", PAGE_ALL)],
    "tokens:revoke": [page("POST", "/tokens/{alice_token}/revoke/", roles(302, 302, 404, 404, 404, 404))],
    "nodes:list": [page("GET", "/nodes/", STAFF_PAGE)],
    "nodes:drain": [page("POST", "/nodes/gpu-01/drain/", roles(302, 403, 403, 403, 403, 302))],
    # gpu-01 is ready: undrain is refused with a message and a redirect.
    "nodes:undrain": [page("POST", "/nodes/gpu-01/undrain/", roles(302, 403, 403, 403, 403, 302))],
    # Billing (portal/billing): usage follows project visibility; invoices are for an
    # organization's owners and staff only ({acme_invoice} is acme's).
    "api:usage": [e("GET", "/api/v1/usage/", ALL_200), e("GET", "/api/v1/usage/?project=vision", VISION_READ)],
    "api:budgets": [e("GET", "/api/v1/budgets/", ALL_200)],
    "api:invoice-list": [e("GET", "/api/v1/invoices/", ALL_200)],
    "api:invoice-detail": [e("GET", "/api/v1/invoices/{acme_invoice}/", roles(401, 200, 404, 404, 404, 200))],
    # Prometheus scrape: staff (session or token) or METRICS_SCRAPE_TOKEN; errors keep the API shape.
    "metrics:prometheus": [e("GET", "/metrics", roles(401, 403, 403, 403, 403, 200))],
    "console:index": [e("GET", "/console/", roles(302, 403, 403, 403, 403, 200), api=False)],
    "console:autoscaling": [e("GET", "/console/autoscaling/", roles(302, 403, 403, 403, 403, 200), api=False)],
    "admin:index": [e("GET", "/admin/", roles(302, 302, 302, 302, 302, 200), api=False)],
}


def _names(resolver=None, namespace=""):
    resolver = resolver or get_resolver()
    for item in resolver.url_patterns:
        if isinstance(item, URLResolver):
            ns = f"{namespace}{item.namespace}:" if item.namespace else namespace
            yield from _names(item, ns)
        elif isinstance(item, URLPattern) and item.name:
            yield f"{namespace}{item.name}"


def test_every_url_has_an_entry():
    missing = []
    for name in set(_names()):
        if name in MATRIX:
            continue
        if any(name.startswith(prefix) for prefix in COVERED_BY_PREFIX):
            continue
        missing.append(name)
    assert not missing, f"URL names without an isolation-matrix entry: {sorted(missing)}"


def _cases():
    for name, rows in MATRIX.items():
        for i, row in enumerate(rows):
            for persona in SESSION_PERSONAS + list(TOKEN_PERSONAS):
                yield pytest.param(name, i, persona, id=f"{name}[{row['method']}]-{persona}")


def _expected(row, persona):
    if persona in row["expect"]:
        return row["expect"][persona]
    if persona in TOKEN_PERSONAS:
        user, scopes, _ = TOKEN_PERSONAS[persona]
        if not row["api"]:
            # Pages ignore Bearer tokens: the request is anonymous there.
            return row["expect"]["anonymous"]
        if row["scope"] not in scopes:
            return 403
        return row["expect"][user]
    return row["expect"][persona]


@pytest.mark.parametrize("name,index,persona", list(_cases()))
def test_matrix(demo, api, name, index, persona):
    row = MATRIX[name][index]
    alice_token_id = _alice_token(demo.users["alice"]).pk
    fixtures = _tenant_objects(demo)
    if persona == "anonymous":
        client = api()
    elif persona in TOKEN_PERSONAS:
        user, scopes, restricted = TOKEN_PERSONAS[persona]
        client = api(token=make_token(demo.users[user], scopes, project=demo.vision if restricted else None))
    else:
        client = api(persona)
    url = row["url"].format(alice_token=alice_token_id, **fixtures)
    response = getattr(client, row["method"].lower())(url, data=row["body"], format="json")
    assert response.status_code == _expected(row, persona), getattr(response, "data", response.content[:300])
    if row["api"] and response.status_code >= 400:
        assert set(response.json()["error"]) >= {"status", "code", "message", "fields"}


def _tenant_objects(demo):
    """A job and a template in vision, and a node, for the rows that need them."""
    from portal.core.context import Actor
    from portal.jobs.services import job_submit, template_save
    from portal.nodes.services import node_add
    from portal.storage.datasets import dataset_create
    from portal.storage.services import registry_credential_set, volume_create, volume_file_put

    alice = Actor(user=demo.users["alice"])
    job, _ = job_submit(actor=alice, data={"project": "vision", "name": "fixture", "image": "gpuportal/busybox:latest",
                                           "command": ["true"], "ports": [{"name": "lab", "kind": "jupyter"}]})
    template = template_save(actor=alice, project=demo.vision, name="t1", spec={"image": "gpuportal/busybox:latest"},
                             locked=[])
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    volume = volume_create(actor=alice, project=demo.vision, name="data")
    volume_file_put(actor=alice, volume=volume, path="f.txt", stream=io.BytesIO(b"f"), length=1)
    credential = registry_credential_set(actor=alice, project=demo.vision, registry="registry.example.org:5000",
                                         username="ci", secret="s3cret")
    return {"vision_job": job.pk, "vision_template": template.pk, "acme_invoice": _acme_invoice(),
            "vision_volume": volume.pk, "vision_session": job.sessions.get().pk,
            "vision_registry_credential": credential.pk,
            "vision_dataset": dataset_create(actor=alice, project=demo.vision, name="tiny").pk}


def _acme_invoice() -> int:
    from datetime import date

    from django.utils import timezone

    from portal.billing.models import Invoice
    from portal.tenancy.models import Organization

    return Invoice.objects.create(organization=Organization.objects.get(slug="acme"), month=date(2026, 11, 1),
                                  generated_at=timezone.now()).pk


def _alice_token(alice):
    from portal.accounts.models import ApiToken

    make_token(alice, ["read"])
    return ApiToken.objects.filter(user=alice).latest("id")


@pytest.mark.parametrize("username,visible", [
    ("alice", {"vision"}), ("bob", {"vision"}), ("dave", {"vision"}), ("charlie", {"nlp"}), ("admin", {"vision", "nlp"}),
])
def test_lists_show_only_own_tenant(demo, api, username, visible):
    client = api(username)
    projects = {p["slug"] for p in client.get("/api/v1/projects/").json()["results"]}
    assert projects == visible
    orgs = {o["slug"] for o in client.get("/api/v1/organizations/").json()["results"]}
    assert orgs == {{"vision": "acme", "nlp": "globex"}[p] for p in visible}


def test_project_restricted_token_sees_only_its_project(demo, api):
    from portal.tenancy.models import Organization, Project
    from portal.tenancy.services import membership_add, project_create
    from portal.core.context import Actor

    staff = Actor(user=demo.users["admin"])
    other = project_create(actor=staff, organization=Organization.objects.get(slug="acme"), slug="audio", name="Audio")
    membership_add(actor=staff, project=other, username="alice", role="owner")
    token = make_token(demo.users["alice"], ["read"], project=demo.vision)
    client = api(token=token)
    assert {p["slug"] for p in client.get("/api/v1/projects/").json()["results"]} == {"vision"}
    assert client.get("/api/v1/projects/audio/").status_code == 404
    assert client.get("/api/v1/projects/audio/members/").status_code == 404
    assert [m["project"] for m in client.get("/api/v1/me/").json()["memberships"]] == ["vision"]
    # Without the restriction alice sees both.
    assert {p["slug"] for p in api("alice").get("/api/v1/projects/").json()["results"]} == {"vision", "audio"}
    assert Project.objects.count() == 3
