"""Artifacts through the portal: the agent API takes an attempt's files (node tokens, only for an attempt
that ran on that node), the jobs API lists and downloads them (tenant-scoped), each on the local folder
and on a real S3-compatible server (SeaweedFS); bad paths, over-limit uploads and outsiders are refused."""
import hashlib

import pytest
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.jobs.services import job_cancel, job_submit
from portal.nodes.services import node_add
from portal.storage.models import Artifact
from tests.jobs.test_logs import node, placed  # noqa: F401 (node gpu-01 and a job placed on it)

pytestmark = pytest.mark.django_db
IMAGE = "gpuportal/busybox:latest"


def _node(demo, name, gpus="2xH100-80GB"):
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus=gpus)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def put(node, job, path, body: bytes, attempt=1):
    return node.put(f"/api/agent/v1/jobs/{job.pk}/artifacts?attempt={attempt}&path={path}", data=body,
                    content_type="application/octet-stream")


def fetch(client, url, kind) -> bytes:
    """The artifact's bytes as a browser or gpuctl gets them: streamed by the portal from a local folder; from
    S3 a redirect to a presigned URL, fetched from the storage itself without the portal's credentials."""
    import requests

    r = client.get(url)
    if kind == "local":
        assert r.status_code == 200 and r["Content-Disposition"].startswith("attachment"), r
        return b"".join(r.streaming_content)
    assert r.status_code == 302 and r["Cache-Control"] == "no-store", r
    got = requests.get(r["Location"], timeout=30)
    assert got.status_code == 200 and got.headers["Content-Disposition"].startswith("attachment"), got.text
    return got.content


def test_an_attempts_files_are_stored_listed_and_downloaded(node, placed, api, artifact_storage):
    data = {"model.pt": b"\x00weights\xff" * 1000, "logs/metrics.json": b'{"loss": 0.1}\n'}
    for path, body in data.items():
        r = put(node, placed, path, body)
        assert r.status_code == 201, r.content
        assert r.json() == {"path": path, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    assert artifact_storage() == [f"jobs/{placed.pk}/1/logs/metrics.json", f"jobs/{placed.pk}/1/model.pt"]

    listing = api("dave").get(f"/api/v1/jobs/{placed.pk}/artifacts/")  # a viewer of the project
    assert listing.status_code == 200
    assert [(a["attempt"], a["path"], a["size"]) for a in listing.json()] == [
        (1, "logs/metrics.json", len(data["logs/metrics.json"])), (1, "model.pt", len(data["model.pt"]))]
    for a in listing.json():
        url = f"/api/v1/jobs/{placed.pk}/artifacts/{a['id']}/"
        body = fetch(api("dave"), url, artifact_storage.kind)
        assert body == data[a["path"]] and hashlib.sha256(body).hexdigest() == a["sha256"] == \
            api("dave").get(url)["X-Checksum-Sha256"]

    # A retried upload replaces the file (never a second copy under another name).
    assert put(node, placed, "model.pt", b"v2").status_code == 201
    assert artifact_storage() == [f"jobs/{placed.pk}/1/logs/metrics.json", f"jobs/{placed.pk}/1/model.pt"]
    model = Artifact.objects.get(job=placed, path="model.pt")
    assert fetch(api("alice"), f"/api/v1/jobs/{placed.pk}/artifacts/{model.pk}/", artifact_storage.kind) == b"v2"


def test_outsiders_get_404(node, placed, demo, api, artifact_storage):
    assert put(node, placed, "out.txt", b"secret").status_code == 201
    artifact = Artifact.objects.get()
    charlie = api("charlie")  # owner of another organization's project
    assert charlie.get(f"/api/v1/jobs/{placed.pk}/artifacts/").status_code == 404
    assert charlie.get(f"/api/v1/jobs/{placed.pk}/artifacts/{artifact.pk}/").status_code == 404
    # An artifact id of another job is not this job's.
    other, _ = job_submit(actor=Actor(user=demo.users["charlie"]), data={"project": "nlp", "name": "o", "image": IMAGE, "command": ["true"]})
    assert charlie.get(f"/api/v1/jobs/{other.pk}/artifacts/{artifact.pk}/").status_code == 404
    assert APIClient().get(f"/api/v1/jobs/{placed.pk}/artifacts/").status_code in (401, 403)
    # User tokens do not work on the agent API, nor node tokens on the user API.
    assert node.get(f"/api/v1/jobs/{placed.pk}/artifacts/").status_code in (401, 403)


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../b", "a\x01b", "", "a//b/..", "x" * 300])
def test_bad_paths_are_refused_with_the_field(node, placed, path, artifact_storage):
    r = node.put(f"/api/agent/v1/jobs/{placed.pk}/artifacts", QUERY_STRING=f"attempt=1&path={_q(path)}",
                 data=b"x", content_type="application/octet-stream")
    assert r.status_code == 400 and "path" in r.json()["error"]["fields"], r.content
    assert artifact_storage() == [] and not Artifact.objects.exists()


def _q(s: str) -> str:
    import urllib.parse

    return urllib.parse.quote(s, safe="")


def test_over_the_limit_is_413_and_stores_nothing(node, placed, settings, api, artifact_storage):
    settings.ARTIFACTS_MAX_MB = 1
    settings.ARTIFACTS_MAX_FILES = 2
    assert put(node, placed, "a.bin", b"a" * 700_000).status_code == 201
    r = put(node, placed, "b.bin", b"b" * 400_000)  # 1.1 MB in all
    assert r.status_code == 413 and r.json()["error"]["code"] == "artifacts_too_large", r.content
    assert "1 MB per attempt" in r.json()["error"]["message"]
    # Sent without a length (chunked): WSGI would read it as empty, so it is refused.
    r = node.generic("PUT", f"/api/agent/v1/jobs/{placed.pk}/artifacts?attempt=1&path=c.bin",
                     data=b"c" * 10, content_type="application/octet-stream", CONTENT_LENGTH="")
    assert r.status_code == 411 and "file" in r.json()["error"]["fields"], r.content
    assert put(node, placed, "d.bin", b"d").status_code == 201
    r = put(node, placed, "e.bin", b"e")
    assert r.status_code == 413 and r.json()["error"]["code"] == "artifacts_too_many"
    # Replacing a file already kept counts it once.
    assert put(node, placed, "a.bin", b"A" * 700_000).status_code == 201
    assert artifact_storage() == [f"jobs/{placed.pk}/1/a.bin", f"jobs/{placed.pk}/1/d.bin"]
    assert sorted(a["path"] for a in api("alice").get(f"/api/v1/jobs/{placed.pk}/artifacts/").json()) == \
        ["a.bin", "d.bin"]


def test_only_the_node_that_ran_the_attempt_may_upload(node, placed, demo, api, artifact_storage):
    other = _node(demo, "gpu-02")
    r = put(other, placed, "x", b"x")
    assert r.status_code == 409 and not Artifact.objects.exists()
    assert put(node, placed, "x", b"x", attempt=2).status_code == 409  # an attempt that never was
    assert node.put("/api/agent/v1/jobs/999999/artifacts?attempt=1&path=x", data=b"x",
                    content_type="application/octet-stream").status_code == 409
    # After a cancel (or a preemption) the GPUs are freed before the agent stops the sandbox and
    # uploads: the node that ran the attempt may still upload its files.
    job_cancel(actor=Actor(user=demo.users["alice"]), job=placed)
    placed.refresh_from_db()
    assert placed.state == "cancelled"
    assert put(node, placed, "late.txt", b"after the stop").status_code == 201
    assert put(other, placed, "late.txt", b"x").status_code == 409
    assert [a["path"] for a in api("alice").get(f"/api/v1/jobs/{placed.pk}/artifacts/").json()] == ["late.txt"]


def test_attempts_keep_their_own_artifacts(node, placed, api, artifact_storage):
    assert put(node, placed, "out.txt", b"first").status_code == 201
    Job.objects.filter(pk=placed.pk).update(attempt=2)  # requeued and placed again on the same node
    assert put(node, placed, "out.txt", b"second", attempt=2).status_code == 201
    alice = api("alice")
    assert [(a["attempt"], a["path"]) for a in alice.get(f"/api/v1/jobs/{placed.pk}/artifacts/").json()] == [
        (1, "out.txt"), (2, "out.txt")]
    only = alice.get(f"/api/v1/jobs/{placed.pk}/artifacts/?attempt=2").json()
    assert [a["attempt"] for a in only] == [2]
    assert alice.get(f"/api/v1/jobs/{placed.pk}/artifacts/?attempt=x").status_code == 400


def test_the_job_page_lists_them_with_download_links(node, placed, client, demo, artifact_storage):
    assert put(node, placed, "results/summary.csv", b"a,b\n").status_code == 201
    artifact = Artifact.objects.get()
    client.force_login(demo.users["dave"])
    page = client.get(f"/jobs/{placed.pk}/").content.decode()
    link = f"/api/v1/jobs/{placed.pk}/artifacts/{artifact.pk}/"
    assert 'id="artifacts-h"' in page and f'href="{link}"' in page and "results/summary.csv" in page
    assert fetch(client, link, artifact_storage.kind) == b"a,b\n"
    client.force_login(demo.users["charlie"])
    assert client.get(f"/jobs/{placed.pk}/").status_code == 404
    assert client.get(link).status_code == 404


def test_s3_downloads_are_short_lived_presigned_redirects(node, placed, demo, api, settings, seaweedfs):
    """With an S3-compatible storage (SeaweedFS) the portal answers with a presigned URL: the storage serves
    the bytes, only until the URL expires; outsiders get 404 and no URL; ARTIFACTS_PRESIGN_S=0 streams."""
    import urllib.parse
    from datetime import timedelta

    import requests
    import time_machine
    from django.utils import timezone

    from tests.storage.conftest import s3_artifacts

    settings.STORAGES = {**settings.STORAGES, "artifacts": s3_artifacts(seaweedfs, f"t-{placed.pk}-presign")}
    body = bytes(range(256)) * 4096  # 1 MiB
    assert put(node, placed, "ckpt/model.bin", body).status_code == 201
    artifact = Artifact.objects.get()
    url = f"/api/v1/jobs/{placed.pk}/artifacts/{artifact.pk}/"

    settings.ARTIFACTS_PRESIGN_S = 120
    r = api("dave").get(url)
    assert r.status_code == 302 and r["X-Checksum-Sha256"] == artifact.sha256
    location = urllib.parse.urlsplit(r["Location"])
    query = urllib.parse.parse_qs(location.query)
    assert r["Location"].startswith(seaweedfs.endpoint + "/") and query["X-Amz-Expires"] == ["120"]
    assert "Authorization" not in r and "token" not in r["Location"].lower()
    got = requests.get(r["Location"], timeout=30)
    assert got.status_code == 200 and got.content == body
    assert got.headers["Content-Disposition"] == 'attachment; filename="model.bin"'
    # A name that is not ASCII (or holds quotes) keeps its name, as the portal's own attachments do.
    assert put(node, placed, _q("résumé \"v2\".txt"), b"cv").status_code == 201
    odd = Artifact.objects.get(path='résumé "v2".txt')
    got = requests.get(api("dave").get(f"/api/v1/jobs/{placed.pk}/artifacts/{odd.pk}/")["Location"], timeout=30)
    assert got.content == b"cv"
    assert got.headers["Content-Disposition"] == "attachment; filename*=utf-8''r%C3%A9sum%C3%A9%20%22v2%22.txt"
    # The signature covers the key: the same URL on another object is refused.
    other = r["Location"].replace("model.bin", "other.bin")
    assert requests.get(other, timeout=30).status_code == 403

    # A URL signed 100 s ago still works; one signed 121 s ago (its 120 s over) is refused by the storage.
    with time_machine.travel(timezone.now() - timedelta(seconds=100), tick=False):
        recent = api("dave").get(url)["Location"]
    assert requests.get(recent, timeout=30).content == body
    with time_machine.travel(timezone.now() - timedelta(seconds=121), tick=False):
        old = api("dave").get(url)["Location"]
    expired = requests.get(old, timeout=30)
    assert expired.status_code == 403 and body[:64] not in expired.content

    # Outsiders: 404, no URL.
    r = api("charlie").get(url)
    assert r.status_code == 404 and "Location" not in r and seaweedfs.endpoint not in r.content.decode()

    settings.ARTIFACTS_PRESIGN_S = 0  # streamed through the portal after all
    r = api("dave").get(url)
    assert r.status_code == 200 and b"".join(r.streaming_content) == body
