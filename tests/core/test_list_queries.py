"""Every list endpoint and list page keeps a fixed number of queries, whatever the number of rows it
shows (an N+1 guard): each case is measured with a few rows and again with many more, and the two
counts must be equal. A query per row (a missing select_related/prefetch_related) makes them differ."""
import itertools

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.core.context import Actor
from portal.jobs.services import job_submit, template_save
from portal.nodes.services import node_add
from portal.storage.services import volume_create
from portal.tenancy.models import Organization
from portal.tenancy.services import membership_add, organization_create, project_create
from tests.conftest import make_token

IMAGE = "gpuportal/busybox:latest"
FEW, MANY = 2, 12
_seq = itertools.count()


def _name(prefix: str) -> str:
    return f"{prefix}-{next(_seq)}"


def add_tokens(demo, n):
    for _ in range(n):
        make_token(demo.users["alice"], ["read"])


def add_jobs(demo, n):
    for _ in range(n):
        job_submit(actor=Actor(user=demo.users["alice"]), data={
            "project": "vision", "name": "j", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}})


def add_templates(demo, n):
    for _ in range(n):
        template_save(actor=Actor(user=demo.users["alice"]), project=demo.vision, name=_name("tpl"),
                      spec={"image": IMAGE}, locked=["image"])


def add_nodes(demo, n):
    for _ in range(n):
        node_add(actor=Actor(user=demo.users["admin"]), name=_name("node"), gpus="2xH100-80GB")


def add_volumes(demo, n):
    for _ in range(n):
        volume_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name=_name("vol"))


def add_datasets(demo, n):
    from portal.storage.datasets import dataset_create

    for _ in range(n):
        dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name=_name("ds"),
                       source={"kind": "http", "url": "http://127.0.0.1:9/set.tar"})


def add_members(demo, n):
    User = get_user_model()
    for _ in range(n):
        user = User.objects.create_user(_name("user"))
        membership_add(actor=Actor(user=demo.users["alice"]), project=demo.vision, username=user.username,
                       role="member")


def add_projects(demo, n):
    admin = Actor(user=demo.users["admin"])
    acme = Organization.objects.get(slug="acme")
    for _ in range(n):
        slug = _name("proj")
        project_create(actor=admin, organization=acme, slug=slug, name=slug, owner=demo.users["alice"])


def add_budgeted_projects(demo, n):
    admin = Actor(user=demo.users["admin"])
    acme = Organization.objects.get(slug="acme")
    for _ in range(n):
        slug = _name("proj")
        project_create(actor=admin, organization=acme, slug=slug, name=slug, owner=demo.users["alice"],
                       quota={"gpu_hours_budget": 100})


def add_organizations(demo, n):
    for _ in range(n):
        slug = _name("org")
        organization_create(actor=Actor(user=demo.users["admin"]), slug=slug, name=slug)


def add_invoices(demo, n):
    from datetime import date

    from django.utils import timezone

    from portal.billing.models import Invoice, InvoiceLine

    for _ in range(n):
        slug = _name("org")
        org = organization_create(actor=Actor(user=demo.users["admin"]), slug=slug, name=slug)
        project = project_create(actor=Actor(user=demo.users["admin"]), organization=org, slug=slug, name=slug)
        invoice = Invoice.objects.create(organization=org, month=date(2026, 11, 1), generated_at=timezone.now())
        InvoiceLine.objects.create(invoice=invoice, project=project, gpu_model="H100-80GB", gpu_seconds=3600,
                                   amount=2)


def add_usage(demo, n):
    """n users of vision, each with a job that ran an hour (one ledger row each)."""
    from django.utils import timezone

    from portal.billing.models import UsageRecord
    from portal.jobs.models import Allocation
    from scheduler.adapter import run_pass

    from portal.nodes.models import Node

    if not Node.objects.exists():
        for name in ("usage-a", "usage-b"):  # room for MANY one-GPU jobs
            node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus="8xH100-80GB")
    add_members(demo, n)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for membership in demo.vision.memberships.select_related("user").order_by("-pk")[:n]:
        job, _ = job_submit(actor=Actor(user=membership.user), data={
            "project": "vision", "name": "j", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}})
        run_pass()
        allocation = Allocation.objects.get(job=job)
        UsageRecord.objects.create(allocation=allocation, hour=hour, project=demo.vision,
                                   organization=demo.vision.organization, user=membership.user, job_id=job.pk,
                                   gpu_model="H100-80GB", fraction=1, priority="normal", gpu_seconds=3600,
                                   unit_price=2, amount=2)


def add_pools(demo, n):
    from portal.autoscale.models import NodePool

    for _ in range(n):
        NodePool.objects.create(name=_name("pool"))


def _alice_job(demo):
    from portal.jobs.models import Job

    job = Job.objects.filter(user=demo.users["alice"]).first()
    if job is None:
        add_jobs(demo, 1)
        job = Job.objects.filter(user=demo.users["alice"]).first()
    return job


def add_sessions(demo, n):
    from portal.interactive.models import Session

    for _ in range(n):
        add_jobs(demo, 1)
        job = demo.users["alice"].jobs.order_by("-pk").first()
        Session.objects.create(job=job, name=_name("s"), kind="http", port=8000)


def add_artifacts(demo, n):
    from portal.storage.models import Artifact

    job = _alice_job(demo)
    for _ in range(n):
        path = _name("out") + ".txt"
        Artifact.objects.create(job=job, attempt=1, path=path, size=1, sha256="0" * 64, storage_name=path)


def add_registry_credentials(demo, n):
    from portal.storage.services import registry_credential_set

    for _ in range(n):
        registry_credential_set(actor=Actor(user=demo.users["alice"]), project=demo.vision,
                                registry=_name("registry") + ".example.org", username="ci", secret="s3cret")


# (who looks, the URL, how to add rows to it)
CASES = {
    "api tokens": ("alice", "/api/v1/tokens/", add_tokens),
    "api jobs": ("alice", "/api/v1/jobs/?page_size=100", add_jobs),
    "api job-templates": ("alice", "/api/v1/job-templates/", add_templates),
    "api nodes": ("admin", "/api/v1/nodes/", add_nodes),
    "api cluster": ("admin", "/api/v1/cluster/", add_nodes),
    "api volumes": ("alice", "/api/v1/volumes/", add_volumes),
    "api datasets": ("alice", "/api/v1/datasets/", add_datasets),
    "api members": ("alice", "/api/v1/projects/vision/members/", add_members),
    "api projects": ("alice", "/api/v1/projects/", add_projects),
    "api organizations": ("admin", "/api/v1/organizations/", add_organizations),
    "api budgets": ("alice", "/api/v1/budgets/", add_budgeted_projects),
    "api invoices": ("admin", "/api/v1/invoices/", add_invoices),
    "api sessions": ("alice", "/api/v1/sessions/", add_sessions),
    "api artifacts": ("alice", "/api/v1/jobs/{job}/artifacts/", add_artifacts),
    "api registry-credentials": ("alice", "/api/v1/registry-credentials/", add_registry_credentials),
    "api usage by user": ("alice", "/api/v1/usage/?group_by=user", add_usage),
    "api usage by job": ("alice", "/api/v1/usage/jobs/", add_usage),
    "page home": ("alice", "/", add_projects),
    "page jobs": ("alice", "/jobs/", add_jobs),
    "page tokens": ("alice", "/tokens/", add_tokens),
    "page nodes": ("admin", "/nodes/", add_nodes),
    "page cluster": ("admin", "/cluster/", add_nodes),
    "page console": ("admin", "/console/", add_nodes),
    "page project members": ("alice", "/projects/vision/", add_members),
    "page project templates": ("alice", "/projects/vision/", add_templates),
    "page console autoscaling": ("admin", "/console/autoscaling/", add_pools),
    "page volumes": ("alice", "/projects/vision/volumes/", add_volumes),
    "page datasets": ("alice", "/projects/vision/datasets/", add_datasets),
}


@pytest.mark.parametrize("case", list(CASES))
def test_list_queries_do_not_grow_with_rows(case, demo, api, sent):
    who, url, add = CASES[case]
    client = api(who)
    if "{job}" in url:
        url = url.format(job=_alice_job(demo).pk)

    def count() -> tuple[int, int]:
        client.get(url)  # the first request fills per-process caches
        with CaptureQueriesContext(connection) as queries:
            r = client.get(url)
        assert r.status_code == 200, (url, r.status_code)
        return len(queries), len(r.content)

    add(demo, FEW)
    few, few_size = count()
    add(demo, MANY - FEW)
    many, many_size = count()
    assert many_size > few_size, f"{url} does not show the rows added"
    assert many == few, f"{url}: {few} queries with {FEW} more rows, {many} with {MANY}"


def test_every_api_list_endpoint_has_a_case():
    """A new list endpoint (a viewset's list action under /api/v1/) needs its row in CASES."""
    from django.urls import URLResolver, get_resolver, resolve

    def list_routes(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                yield from list_routes(p.url_patterns, prefix + str(p.pattern))
            elif prefix.startswith("api/v1/") and (getattr(p.callback, "actions", None) or {}).get("get") == "list":
                yield p.name

    covered = {resolve(url.split("?")[0].format(job=1)).url_name for _, url, _ in CASES.values()}
    missing = set(list_routes(get_resolver().url_patterns)) - covered
    assert not missing, f"list endpoints without a query-count case: {sorted(missing)}"
