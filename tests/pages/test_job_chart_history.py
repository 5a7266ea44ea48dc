"""The job page's charts start at the job's start: /jobs/<id>/metrics/?history=1 brings the
attempt's minute rollups since it got its GPUs, on one time axis, for members only."""
from datetime import timedelta

from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.metrics.services import rollup_minutes, samples_write
from portal.nodes.services import node_add


def test_history_starts_at_the_jobs_start(demo, browser, submit, monkeypatch):
    from scheduler.adapter import run_pass

    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    job = submit(resources={"gpus": 1})
    run_pass()
    now = timezone.now()
    started = now - timedelta(minutes=20)
    Allocation.objects.filter(job=job).update(started_at=started)
    mine = Allocation.objects.get(job=job).gpu
    other = node.gpus.exclude(pk=mine.pk).get()
    # Samples from before the job got its GPU (another tenant's minutes) and during it.
    samples_write([(g.pk, now - timedelta(minutes=m), 70.0 if m < 20 else 5.0, 500, 81920, 60.0, 300.0, 0, [])
                   for g in (mine, other) for m in range(1, 40)])
    rollup_minutes(now=now, lookback_minutes=45)

    body = browser("alice").get(f"/jobs/{job.pk}/metrics/", {"history": "1"}).json()
    assert body["started"] == int(started.timestamp()) and body["ended"] is None
    history = body["history"]
    assert list(history["gpus"]) == [mine.uuid]  # only the job's own GPU
    assert history["t"] and history["t"][0] >= int(started.timestamp()) - 90
    assert history["t"] == sorted(history["t"])
    assert set(history["gpus"][mine.uuid]["utilization"]) <= {70.0, 5.0} and 70.0 in \
        history["gpus"][mine.uuid]["utilization"]
    assert len(history["gpus"][mine.uuid]["power_w"]) == len(history["t"])
    assert "history" not in browser("alice").get(f"/jobs/{job.pk}/metrics/").json()  # later polls: latest only
    assert browser("charlie").get(f"/jobs/{job.pk}/metrics/", {"history": "1"}).status_code == 404
