"""The admin console: staff only, and it renders real numbers."""
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.billing.services import usage_meter
from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.jobs.services import job_submit
from portal.metrics.services import rollup_hours, rollup_minutes, samples_write
from portal.nodes.models import GPU
from portal.nodes.services import node_add
from scheduler.adapter import run_pass


@pytest.fixture
def busy(demo, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    gpus = list(node.gpus.order_by("index"))
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})
    run_pass()
    now = timezone.now()
    # The job has held its GPU for an hour without using it.
    Allocation.objects.filter(job=job).update(started_at=now - timedelta(hours=1))
    held = Allocation.objects.get(job=job).gpu_id
    rows = []
    for minute in range(1, 40):
        ts = now - timedelta(minutes=minute)
        for g in gpus:
            util = 0.0 if g.pk == held else 88.0
            rows.append((g.pk, ts, util, 100, 81920, 60.0, 250.0, 0, []))
    samples_write(rows)
    rollup_minutes(now=now, lookback_minutes=45)
    rollup_hours(now=now)
    GPU.objects.filter(pk=gpus[1].pk).update(health="unhealthy", health_reason="Xid error 79 reported by the driver")
    usage_meter()
    return demo


def test_anonymous_goes_to_login(busy, client):
    r = client.get("/console/")
    assert r.status_code == 302 and r["Location"].startswith("/login/")


@pytest.mark.parametrize("username", ["alice", "bob", "dave", "charlie"])
def test_tenants_get_403(busy, client, username):
    client.force_login(busy.users[username])
    assert client.get("/console/").status_code == 403


@pytest.mark.clock
def test_staff_sees_charts_and_numbers(clock, busy, client):
    client.force_login(busy.users["admin"])
    r = client.get("/console/")
    assert r.status_code == 200
    html = r.content.decode()
    assert html.count("<svg") >= 4 and html.count("<details>") >= 5
    assert "Xid error 79" in html  # unhealthy GPUs
    assert "vision" in html  # idle-but-allocated row and revenue by project
    assert '<th scope="row">gpu-01</th><td>' in html  # heat map numbers
    assert "No idle allocated GPU." not in html
    assert UsageRecord.objects.filter(project=busy.vision).exists()
    assert Decimal(0) <= sum(r.gpu_seconds for r in UsageRecord.objects.all())
