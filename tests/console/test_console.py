"""The admin console: staff only, and it renders real numbers."""
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from portal.billing.models import UsageRecord
from portal.billing.services import usage_meter
from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.jobs.services import job_submit
from portal.metrics.models import FleetRollup, Resolution
from portal.metrics.services import rollup_hours, rollup_minutes, samples_write
from portal.nodes.models import GPU
from portal.nodes.services import node_add
from scheduler.adapter import run_pass


def placed_job(demo, *, node: str, gpus: int, job_gpus: int, held_for: timedelta, now):
    """A node of `gpus` H100s and alice's job of `job_gpus` GPUs placed on it `held_for` ago."""
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name=node, gpus=f"{gpus}xH100-80GB")
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": job_gpus}})
    run_pass()
    Allocation.objects.filter(job=job).update(started_at=now - held_for)
    return list(node.gpus.order_by("index")), job


@pytest.fixture
def busy(demo, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    now = timezone.now()
    # The job has held its GPU for an hour without using it.
    gpus, job = placed_job(demo, node="gpu-01", gpus=2, job_gpus=1, held_for=timedelta(hours=1), now=now)
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
    assert html.count('data-chart="') == 4 and html.count("<details>") == 2
    assert 'id="console-data" type="application/json"' in html and "<svg" not in html
    assert "Xid error 79" in html  # unhealthy GPUs
    assert 'href="/console/" aria-current="page">Console</a>' in html  # staff reach it from the top bar
    assert "vision" in html  # idle-but-allocated row and revenue by project
    # The heat map: a number and a colour step per GPU (the held GPU idles, the other runs at 88 %).
    assert re.search(r'<th scope="row">gpu-01</th>(<td class="heat-0">0</td><td class="heat-9">88</td>|'
                     r'<td class="heat-9">88</td><td class="heat-0">0</td>)</tr>', html)
    assert "No idle allocated GPU." not in html
    assert UsageRecord.objects.filter(project=busy.vision).exists()
    assert Decimal(0) <= sum(r.gpu_seconds for r in UsageRecord.objects.all())


@pytest.fixture
def fresh_8gpu_job(demo, monkeypatch):
    """An 8-GPU job running for 10 minutes at 95 %: minute rollups only, and two older hourly fleet
    rows from before it started (what the fleet had once rollup_hours ran twice)."""
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    now = timezone.now()
    gpus, _ = placed_job(demo, node="gpu-08", gpus=8, job_gpus=8, held_for=timedelta(minutes=10), now=now)
    samples_write([(g.pk, now - timedelta(seconds=s), 95.0, 100, 81920, 60.0, 600.0, 0, [])
                   for g in gpus for s in range(5, 600, 20)])
    rollup_minutes(now=now, lookback_minutes=12)
    hour = now.replace(minute=0, second=0, microsecond=0)
    for back in (3, 2):
        FleetRollup.objects.create(resolution=Resolution.HOUR, bucket=hour - timedelta(hours=back), gpus=8,
                                   allocated_gpus=0, used_gpus=0, queued_jobs=0, started_jobs=0)
    return demo


@pytest.mark.parametrize("range_key", ["1h", "24h", "7d", "30d"])
def test_a_running_8_gpu_job_shows_at_once_in_every_range(fresh_8gpu_job, client, range_key):
    client.force_login(fresh_8gpu_job.users["admin"])
    r = client.get(f"/console/?range={range_key}")
    assert r.status_code == 200
    fleet = r.context["chart_data"]["fleet"]
    assert fleet["allocated"][-1] == pytest.approx(8) and fleet["used"][-1] == pytest.approx(7.6)
    if range_key in ("7d", "30d"):
        assert fleet["allocated"][:2] == [0, 0]  # the hourly rows come first, then the minutes
        assert r.content.decode().count(" (hour)</td>") == 2 * 2  # and so in both numbers tables
    heat = dict(r.context["heat"]["rows"])
    assert heat["gpu-08"] == [pytest.approx(95)] * 8
    assert 'aria-current="page">%s</a>' % range_key in r.content.decode()


def test_one_hour_range_reads_minutes_not_hours(fresh_8gpu_job, client):
    client.force_login(fresh_8gpu_job.users["admin"])
    data = client.get("/console/?range=1h").context["chart_data"]
    assert data["end"] - data["start"] == 3600
    assert all(b - a == 60 for a, b in zip(data["fleet"]["t"], data["fleet"]["t"][1:]))


def test_unknown_range_is_400(busy, client):
    client.force_login(busy.users["admin"])
    r = client.get("/console/?range=1y")
    assert r.status_code == 400 and "range: use one of 1h, 24h, 7d, 30d" in r.content.decode()


def test_revenue_has_its_currency_and_a_price(busy, client, settings):
    """seed_demo's rate card prices the demo's GPUs: the hour the job held its GPU is not 0.00."""
    settings.BILLING_CURRENCY = "EUR"
    client.force_login(busy.users["admin"])
    r = client.get("/console/")
    revenue = r.context["revenue"]
    assert revenue["currency"] == "EUR" and revenue["total"] > 0
    assert r.context["chart_data"]["currency"] == "EUR" and r.context["chart_data"]["revenue"]["amount"]
    assert "Amount (EUR)" in r.content.decode()
