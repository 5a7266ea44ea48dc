"""Usage reports, CSV, invoices: scoped to what each persona may see; outsiders get 404."""
import csv
import io
from datetime import date
from decimal import Decimal

import pytest
from django.core.management import call_command

from portal.billing.models import Invoice, UsageRecord
from portal.billing.services import invoice_issue, ratecard_set, usage_meter
from portal.core.context import Actor
from portal.core.errors import Conflict
from portal.jobs.reports import job_report
from portal.nodes.models import Node
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

from tests.conftest import submit


@pytest.fixture
def billed(demo, clock, sent):
    """alice and bob ran work in acme/vision, charlie in globex/nlp, metered and invoiced."""
    admin = Actor(user=demo.users["admin"])
    node_add(actor=admin, name="gpu-01", gpus="4xH100-80GB")
    ratecard_set(actor=admin, gpu_model="H100-80GB", price_per_gpu_hour=Decimal("2"), effective_from=date(2026, 1, 1))
    jobs = [submit(demo, resources={"gpus": 1}), submit(demo, user="bob", resources={"gpus": 2}),
            submit(demo, user="charlie", project="nlp", resources={"gpus": 1})]
    run_pass()
    clock.advance(minutes=50)
    node = Node.objects.get(name="gpu-01")
    for job in jobs:
        job.refresh_from_db()
        job_report(node=node, job_id=str(job.pk), attempt=1, state="succeeded", exit_code=0)
    usage_meter()
    call_command("invoice", "--month", "2026-11", stdout=io.StringIO())
    return demo


def test_usage_by_user_and_project(billed, api):
    r = api("dave").get("/api/v1/usage/?group_by=user")
    assert r.status_code == 200
    body = r.json()
    assert {row["user"]: row["gpu_hours"] for row in body["results"]} == {"alice": "0.833", "bob": "1.667"}
    assert body["total"]["gpu_hours"] == "2.500" and body["total"]["amount"] == "5.00"
    assert [row["project"] for row in api("admin").get("/api/v1/usage/?group_by=project").json()["results"]] == [
        "nlp", "vision"]
    assert api("alice").get("/api/v1/usage/?group_by=day&from=2026-11-03&to=2026-11-04").json()["results"] == [
        {"day": "2026-11-03", "gpu_seconds": "9000.000", "gpu_hours": "2.500", "amount": "5.00"}]
    assert api("alice").get("/api/v1/usage/?from=2026-11-04").json()["results"] == []


def test_outsider_gets_404_for_a_foreign_project_or_organization(billed, api):
    client = api("charlie")
    assert client.get("/api/v1/usage/?project=vision").status_code == 404
    assert client.get("/api/v1/usage/?organization=acme").status_code == 404
    mine = client.get("/api/v1/usage/?group_by=project").json()["results"]
    assert [row["project"] for row in mine] == ["nlp"]


def test_bad_group_by_is_400(billed, api):
    r = api("alice").get("/api/v1/usage/?group_by=planet")
    assert r.status_code == 400 and "group_by" in r.json()["error"]["fields"]
    assert api("alice").get("/api/v1/usage/?from=yesterday").status_code == 400


def test_usage_csv(billed, api):
    r = api("alice").get("/api/v1/usage/?group_by=gpu_model&format=csv")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(r.content.decode())))
    assert rows == [["gpu_model", "gpu_seconds", "gpu_hours", "amount"], ["H100-80GB", "9000.000", "2.500", "5.00"]]
    empty = api("alice").get("/api/v1/usage/?from=2030-01-01&format=csv")
    assert list(csv.reader(io.StringIO(empty.content.decode()))) == [["day", "gpu_seconds", "gpu_hours", "amount"]]


def test_invoices_are_for_owners_and_staff(billed, api):
    acme = Invoice.objects.get(organization__slug="acme")
    assert [i["organization"] for i in api("alice").get("/api/v1/invoices/").json()["results"]] == ["acme"]
    assert [i["organization"] for i in api("charlie").get("/api/v1/invoices/").json()["results"]] == ["globex"]
    assert {i["organization"] for i in api("admin").get("/api/v1/invoices/").json()["results"]} == {"acme", "globex"}
    for member in ("bob", "dave"):
        assert api(member).get("/api/v1/invoices/").json()["results"] == []
        assert api(member).get(f"/api/v1/invoices/{acme.pk}/").status_code == 404
    assert api("charlie").get(f"/api/v1/invoices/{acme.pk}/").status_code == 404
    detail = api("alice").get(f"/api/v1/invoices/{acme.pk}/").json()
    assert detail["month"] == "2026-11" and detail["status"] == "draft"
    # Each record rounds to 1e-6 (6 records of 2/3 or 1 unit here); the total is their exact sum.
    assert Decimal(detail["total"]) == sum(Decimal(line["amount"]) for line in detail["lines"])
    assert abs(Decimal(detail["total"]) - Decimal("5")) < Decimal("0.00001")
    assert [line["project"] for line in detail["lines"]] == ["vision"]


def test_invoice_command_is_idempotent_and_issued_invoices_are_frozen(billed, clock):
    acme = Invoice.objects.get(organization__slug="acme")
    total = acme.total
    call_command("invoice", "--month", "2026-11", stdout=io.StringIO())
    assert Invoice.objects.count() == 2 and Invoice.objects.get(pk=acme.pk).total == total
    invoice_issue(actor=Actor(user=billed.users["admin"]), invoice=acme)
    UsageRecord.objects.filter(organization=acme.organization).update(amount=Decimal("99"))
    call_command("invoice", "--month", "2026-11", "--no-meter", stdout=io.StringIO())
    assert Invoice.objects.get(pk=acme.pk).total == total  # issued: untouched
    with pytest.raises(Conflict):
        invoice_issue(actor=Actor(user=billed.users["admin"]), invoice=acme)


def test_usage_list_query_count_is_flat(billed, api, django_assert_max_num_queries):
    alice, admin = api("alice"), api("admin")
    with django_assert_max_num_queries(8):
        alice.get("/api/v1/usage/?group_by=project")
    with django_assert_max_num_queries(8):
        admin.get("/api/v1/invoices/")
