"""Artifact retention: a project keeps its jobs' artifacts for its quota's artifact_retention_days (else the
site's ARTIFACTS_RETENTION_DAYS; 0 forever). The storage.artifacts_expire beat task deletes the expired
ones from the storage (local folder and SeaweedFS) and their rows, with an audit event per job; nothing
unexpired goes, and a second run deletes nothing more. The API and the job page say when each expires;
the project page shows the project's total."""
import uuid
from datetime import timedelta

import pytest

from portal.celery import app
from portal.core.context import Actor
from portal.core.models import AuditEvent
from portal.jobs.services import job_submit
from portal.storage.models import Artifact
from portal.storage.artifacts import artifacts_expire
from portal.storage.tasks import artifacts_expire as expire_task
from portal.tenancy.models import Quota
from tests.jobs.test_logs import node, placed  # noqa: F401 (node gpu-01 and a job placed on it)

pytestmark = pytest.mark.django_db


def put(node, job, path, body: bytes, attempt=1):
    r = node.put(f"/api/agent/v1/jobs/{job.pk}/artifacts?attempt={attempt}&path={path}", data=body,
                 content_type="application/octet-stream")
    assert r.status_code == 201, r.content
    return Artifact.objects.get(job=job, attempt=attempt, path=path)


def retention(project, days):
    Quota.objects.filter(project=project).update(artifact_retention_days=days)


@pytest.fixture
def local_storage(settings, tmp_path):
    """The artifacts storage on a local folder. -> a function listing the names stored. (Tests that pin
    the clock keep to it: S3 requests signed at a pinned instant are refused as skewed.)"""
    location = tmp_path / "artifacts"
    settings.STORAGES = {**settings.STORAGES, "artifacts": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(location)}}}
    stored = lambda: sorted(str(p.relative_to(location)) for p in location.rglob("*") if p.is_file())  # noqa: E731
    stored.location = location
    return stored


def test_expired_artifacts_go_from_storage_and_rows_and_nothing_else(clock, node, placed, demo, settings,
                                                                      local_storage):
    artifact_storage = local_storage
    settings.ARTIFACTS_RETENTION_DAYS = 30  # the site's default; vision keeps its artifacts 7 days
    retention(demo.vision, 7)
    put(node, placed, "old.bin", b"o" * 1000)
    clock.advance(days=3)
    put(node, placed, "new.bin", b"n" * 10)
    # Another project's job on the site default (30 days): untouched by vision's 7.
    other, _ = job_submit(actor=Actor(user=demo.users["charlie"]), data={
        "project": "nlp", "name": "o", "image": "gpuportal/busybox:latest", "command": ["true"]})
    nlp_file = Artifact.objects.create(job=other, attempt=1, path="keep.txt", size=1, sha256="0" * 64,
                                       storage_name=f"jobs/{other.pk}/1/keep.txt")
    clock.advance(days=4, minutes=-1)  # 1 minute before old.bin expires
    assert artifacts_expire() == {"files": 0, "bytes": 0, "jobs": 0}
    assert sorted(Artifact.objects.values_list("path", flat=True)) == ["keep.txt", "new.bin", "old.bin"]

    clock.advance(minutes=2)
    assert expire_task.apply().get() == {"files": 1, "bytes": 1000, "jobs": 1}  # as the beat runs it
    assert artifact_storage() == [f"jobs/{placed.pk}/1/new.bin"]
    assert sorted(Artifact.objects.values_list("path", flat=True)) == ["keep.txt", "new.bin"]
    event = AuditEvent.objects.get(action="artifacts.expire")
    assert (event.project_id, event.object_id, event.actor_label) == (demo.vision.pk, str(placed.pk), "system")
    assert event.data == {"files": 1, "bytes": 1000, "retention_days": 7}
    # Idempotent: the next run finds nothing more (and writes no second event).
    assert artifacts_expire() == {"files": 0, "bytes": 0, "jobs": 0}
    assert AuditEvent.objects.filter(action="artifacts.expire").count() == 1

    # 0 keeps them forever, however old.
    retention(demo.vision, 0)
    clock.advance(days=400)
    assert artifacts_expire()["files"] == 1  # only nlp's, past the site's 30 days
    assert list(Artifact.objects.values_list("path", flat=True)) == ["new.bin"]
    assert not Artifact.objects.filter(pk=nlp_file.pk).exists()
    assert artifact_storage() == [f"jobs/{placed.pk}/1/new.bin"]
    # Unset: the site's default applies.
    retention(demo.vision, None)
    assert artifacts_expire() == {"files": 1, "bytes": 10, "jobs": 1}
    assert artifact_storage() == [] and not Artifact.objects.exists()


def test_the_site_default_zero_keeps_everything(clock, node, placed, demo, settings, local_storage):
    settings.ARTIFACTS_RETENTION_DAYS = 0
    put(node, placed, "a.txt", b"a")
    clock.advance(days=3650)
    assert artifacts_expire() == {"files": 0, "bytes": 0, "jobs": 0}
    assert local_storage() == [f"jobs/{placed.pk}/1/a.txt"]


def test_expiry_deletes_from_an_s3_bucket(node, placed, demo, settings, seaweedfs):
    """On SeaweedFS (the real clock: S3 signs each request with it; the sweep is told the instant)."""
    from django.utils import timezone

    from tests.storage.conftest import s3_artifacts

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    settings.STORAGES = {**settings.STORAGES, "artifacts": s3_artifacts(seaweedfs, prefix)}
    retention(demo.vision, 2)
    put(node, placed, "a.bin", b"a" * 100)
    put(node, placed, "b/c.bin", b"c" * 5)

    def stored():
        listing = seaweedfs.client().list_objects_v2(Bucket=seaweedfs.bucket, Prefix=prefix + "/").get("Contents", [])
        return sorted(o["Key"].removeprefix(prefix + "/") for o in listing)

    assert stored() == [f"jobs/{placed.pk}/1/a.bin", f"jobs/{placed.pk}/1/b/c.bin"]
    now = timezone.now()
    assert artifacts_expire(now=now + timedelta(days=1))["files"] == 0
    assert artifacts_expire(now=now + timedelta(days=2, minutes=1)) == {"files": 2, "bytes": 105, "jobs": 1}
    assert stored() == [] and not Artifact.objects.exists()
    assert artifacts_expire(now=now + timedelta(days=3))["files"] == 0


def test_a_file_already_gone_from_the_storage_still_loses_its_row(clock, node, placed, demo, local_storage):
    retention(demo.vision, 1)
    put(node, placed, "x.txt", b"x")
    (local_storage.location / f"jobs/{placed.pk}/1/x.txt").unlink()  # deleted by hand, or by a run that died before its rows
    clock.advance(days=2)
    assert artifacts_expire()["files"] == 1 and not Artifact.objects.exists()


def test_the_beat_runs_the_task():
    entry = next(e for e in app.conf.beat_schedule.values() if e["task"] == "storage.artifacts_expire")
    assert entry["schedule"] > 0 and app.tasks["storage.artifacts_expire"].name == expire_task.name


def test_expiry_is_shown_on_the_api_the_job_page_and_the_project_total(clock, node, placed, demo, api, client,
                                                                       settings, local_storage):
    settings.ARTIFACTS_RETENTION_DAYS = 0
    a = put(node, placed, "out/model.pt", b"m" * 2048)
    put(node, placed, "log.txt", b"l" * 48)
    rows = api("dave").get(f"/api/v1/jobs/{placed.pk}/artifacts/").json()
    assert [r["expires_at"] for r in rows] == [None, None]
    client.force_login(demo.users["dave"])
    page = client.get(f"/jobs/{placed.pk}/").content.decode()
    assert "<th scope=\"col\">Expires</th>" in page and ">never</td>" in page

    retention(demo.vision, 14)
    rows = {r["path"]: r for r in api("dave").get(f"/api/v1/jobs/{placed.pk}/artifacts/").json()}
    expected = a.created_at + timedelta(days=14)
    assert rows["out/model.pt"]["expires_at"].replace("Z", "+00:00") == expected.isoformat()
    page = client.get(f"/jobs/{placed.pk}/").content.decode()
    assert f'<time datetime="{expected.isoformat()}">{expected:%Y-%m-%d %H:%M}</time>' in page

    total = client.get(f"/projects/{demo.vision.slug}/").content.decode()
    assert '<dd id="artifacts-total">2 files, 2.0\xa0KB; kept 14 days after upload</dd>' in total
    # Staff set the retention through the quota; bad values are 400 with the field.
    admin = api("admin")
    r = admin.patch(f"/api/v1/projects/{demo.vision.slug}/quota/", {"artifact_retention_days": 90}, format="json")
    assert r.status_code == 200 and r.json()["artifact_retention_days"] == 90
    for bad in (-1, "x", 10**9):
        r = admin.patch(f"/api/v1/projects/{demo.vision.slug}/quota/", {"artifact_retention_days": bad},
                        format="json")
        assert r.status_code == 400 and "artifact_retention_days" in r.json()["error"]["fields"], r.content
    assert api("alice").patch(f"/api/v1/projects/{demo.vision.slug}/quota/", {"artifact_retention_days": 0},
                              format="json").status_code == 403
    assert Quota.objects.get(project=demo.vision).artifact_retention_days == 90
