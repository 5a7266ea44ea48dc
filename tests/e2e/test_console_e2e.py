"""The admin console and the job page's charts in a real Chromium: uPlot draws them from static
files, with no console error and no Content-Security-Policy violation (the `login` fixture fails
the test on any), at every time range."""
from datetime import timedelta

import pytest
from playwright.sync_api import expect

from .conftest import shot

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def running_job(demo, monkeypatch):
    """A 4-GPU job placed 20 minutes ago with minute rollups of its samples, and a month's revenue."""
    from django.utils import timezone

    from portal.billing.services import usage_meter
    from portal.core.context import Actor
    from portal.jobs.models import Allocation
    from portal.jobs.services import job_submit
    from portal.metrics.services import rollup_hours, rollup_minutes, samples_write
    from portal.nodes.services import node_add
    from scheduler.adapter import run_pass

    monkeypatch.setattr("scheduler.dispatch._send", lambda *args, **kwargs: None)
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="4xH100-80GB")
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "train", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 4}})
    run_pass()
    now = timezone.now()
    Allocation.objects.filter(job=job).update(started_at=now - timedelta(minutes=20))
    samples_write([(g.pk, now - timedelta(seconds=s), 90.0, 40000, 81920, 60.0, 500.0, 0, [])
                   for g in node.gpus.all() for s in range(5, 1200, 30)])
    rollup_minutes(now=now, lookback_minutes=25)
    rollup_hours(now=now)
    usage_meter()
    return job


def watch_errors(page) -> list[str]:
    errors = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def test_console_draws_its_charts_at_every_range(running_job, login):
    page = login("admin")
    errors = watch_errors(page)
    page.goto("/console/")
    for key in ("1h", "24h", "7d", "30d"):
        page.get_by_role("navigation", name="Time range").get_by_role("link", name=key, exact=True).click()
        page.wait_for_url(f"**/console/?range={key}")
        expect(page.get_by_role("link", name=key, exact=True)).to_have_attribute("aria-current", "page")
        # Four uPlot charts: fleet GPUs, fleet %, queue, revenue per day.
        expect(page.locator("figure.chart .uplot canvas")).to_have_count(4)
        expect(page.locator('[data-chart="revenue"] .u-legend')).to_contain_text("Revenue")
        expect(page.locator("table.heat tbody th", has_text="gpu-01")).to_be_visible()
    shot(page, "console-30d")
    assert not errors, errors


def test_job_page_charts_start_at_the_jobs_start(running_job, login):
    page = login("alice")
    errors = watch_errors(page)
    page.goto(f"/jobs/{running_job.pk}/")
    expect(page.locator("#gpu-charts .uplot canvas")).to_have_count(3)
    expect(page.locator("#gpu-charts .u-legend").first).to_contain_text("gpu0")
    # Tick labels (drawn on the canvas) in 24-hour UTC whatever the browser's zone: the date under
    # the first tick and under midnight, seconds only when ticks are seconds apart.
    labels = page.evaluate("gpCharts.timeLabels(null, [1764626400, 1764630000, 1764633600], 0, 0, 3600)")
    assert labels == ["22:00\n12-01", "23:00", "00:00\n12-02"]
    assert page.evaluate("gpCharts.timeLabels(null, [1764633600, 1764633605], 0, 0, 5)") == [
        "00:00:00\n12-02", "00:00:05"]
    shot(page, "job-charts")
    assert not errors, errors
