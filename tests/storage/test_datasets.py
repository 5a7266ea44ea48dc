"""Datasets through the API and into jobs, on real parts: an HTTP server on loopback and SeaweedFS (S3).
A version's files, size and digest are read from its source; names and sources are checked field by
field; another tenant's dataset does not exist; a job names versions and its launch spec gives the
node what it fetches, which the node's cache (agents/datasets.py) verifies against the digest."""
import hashlib
import uuid

import pytest

from agents.datasets import ChecksumMismatch, DatasetCache, manifest_digest
from portal.core.context import Actor
from portal.storage.datasets import dataset_create, dataset_version_inspect
from portal.storage.models import Dataset, DatasetVersion
from tests.conftest import agent_client, submit
from tests.httpfiles import tar_archive

MB = 1024 * 1024


@pytest.fixture
def local_artifacts(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "artifacts": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path / "store")}}}


def _create(api, user="alice", **body):
    return api(user).post("/api/v1/datasets/", {"project": "vision", **body}, format="json")


def _ready(dataset_id) -> DatasetVersion:
    """Run the inspection the portal's worker would (storage.dataset_inspect) on the newest version."""
    version = DatasetVersion.objects.filter(dataset_id=dataset_id).order_by("-version").first()
    return dataset_version_inspect(version.pk)


def test_an_http_archive_becomes_a_ready_version_with_its_digest(api, demo, http_files):
    data = tar_archive(gz=False, members={"train/a.txt": b"a" * 1000})
    url = http_files.put("sets/tiny.tar", data)
    r = _create(api, name="tiny", description="a tiny set", source={"kind": "http", "url": url})
    assert r.status_code == 201, r.json()
    body = r.json()
    assert body["mount_path"] == "/datasets/tiny" and body["latest"] is None
    (v,) = body["versions"]
    assert v["version"] == 1 and v["state"] == "pending" and v["digest"] == "" and v["archive"] is True

    version = _ready(body["id"])
    files = [{"path": "tiny.tar", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    assert version.state == "ready" and version.size == len(data) and version.digest == manifest_digest(files)
    shown = api("dave").get(f"/api/v1/datasets/{body['id']}/").json()  # a viewer reads it
    assert shown["latest"] == 1 and shown["versions"][0]["digest"] == version.digest
    assert shown["versions"][0]["size"] == len(data) and shown["versions"][0]["file_count"] == 1


def test_a_missing_url_fails_the_version_saying_why(api, demo, http_files):
    r = _create(api, name="gone", source={"kind": "http", "url": f"{http_files.url}/nothing.tar"})
    version = _ready(r.json()["id"])
    assert version.state == "failed" and "404" in version.message and version.digest == ""


@pytest.fixture
def bucket_set(seaweedfs):
    """Three objects below a fresh prefix of the SeaweedFS bucket -> (prefix, {path: bytes})."""
    prefix = f"ds-{uuid.uuid4().hex[:8]}/v1/"
    objects = {"a.txt": b"alpha", "sub/b.bin": bytes(range(256)) * 40, "sub/c.csv": b"1,2\n"}
    for path, data in objects.items():
        seaweedfs.client().put_object(Bucket=seaweedfs.bucket, Key=prefix + path, Body=data)
    return prefix, objects


def _s3_source(seaweedfs, prefix):
    return {"kind": "s3", "endpoint_url": seaweedfs.endpoint, "bucket": seaweedfs.bucket, "prefix": prefix,
            "access_key": seaweedfs.access_key, "secret_key": seaweedfs.secret_key}


def test_a_bucket_prefix_version_is_fetched_and_verified_by_a_node(api, demo, seaweedfs, bucket_set, tmp_path):
    prefix, objects = bucket_set
    r = _create(api, name="s3set", source=_s3_source(seaweedfs, prefix))
    assert r.status_code == 201, r.json()
    assert "secret_key" not in str(r.json()) and seaweedfs.secret_key not in str(r.json())  # write-only
    version = _ready(r.json()["id"])
    assert version.state == "ready", version.message
    assert sorted(f["path"] for f in version.files) == sorted(objects)
    assert version.size == sum(len(d) for d in objects.values())
    assert r.json()["versions"][0]["location"] == f"s3://{seaweedfs.bucket}/{prefix}"

    # A job names it; the launch spec gives presigned URLs; a node's cache fetches and verifies them.
    job = submit(demo, datasets=["s3set"])
    assert job.datasets == [{"name": "s3set", "version": 1, "digest": version.digest, "size": version.size,
                             "source": f"s3://{seaweedfs.bucket}/{prefix}"}]
    from portal.storage.selectors import launch_datasets

    (entry,) = launch_datasets({job.pk: job.datasets})[job.pk]
    assert entry["digest"] == version.digest and all("X-Amz-Signature" in f["url"] for f in entry["files"])
    cache = DatasetCache(str(tmp_path / "cache"), 10 * MB)
    folder = cache.acquire(f"{job.pk}:1", [entry])["s3set"]
    assert open(f"{folder}/sub/b.bin", "rb").read() == objects["sub/b.bin"]

    # The bucket's object changes after the version was made: the next node refuses it.
    seaweedfs.client().put_object(Bucket=seaweedfs.bucket, Key=prefix + "a.txt", Body=b"ALPHA")
    with pytest.raises(ChecksumMismatch, match="checksum mismatch on a.txt"):
        DatasetCache(str(tmp_path / "other-node"), 10 * MB).acquire(f"{job.pk}:1", [entry])


def test_versions_are_numbered_and_a_name_means_the_latest_ready(api, demo, http_files):
    first = http_files.put("v1.bin", b"one")
    dataset = _create(api, name="evolving", source={"kind": "http", "url": first}).json()
    _ready(dataset["id"])
    second = api("bob").post(f"/api/v1/datasets/{dataset['id']}/versions/",
                             {"source": {"kind": "http", "url": http_files.put("v2.bin", b"two!")}}, format="json")
    assert second.status_code == 201 and second.json()["version"] == 2
    # Pending: "evolving" still means version 1, and naming version 2 is refused with its state.
    assert submit(demo, datasets=["evolving"]).datasets[0]["version"] == 1
    r = api("alice").post("/api/v1/jobs/", {"project": "vision", "image": "gpuportal/busybox:latest",
                                            "command": ["true"], "datasets": ["evolving@2"]}, format="json")
    assert r.status_code == 400 and "is pending" in r.json()["error"]["fields"]["datasets.0"][0]
    _ready(dataset["id"])
    job = submit(demo, datasets=["evolving"])
    assert (job.datasets[0]["version"], job.datasets[0]["size"]) == (2, 4)
    # Versions are immutable: there is no way to change one.
    assert api("alice").patch(f"/api/v1/datasets/{dataset['id']}/", {"name": "x"}, format="json").status_code == 405


@pytest.mark.parametrize("body,field", [
    ({"name": "../x"}, "name"),
    ({"name": "Imagenet"}, "name"),
    ({"name": "a b"}, "name"),
    ({"name": "x" * 64}, "name"),
    ({"name": "ok", "source": {"kind": "ftp", "url": "ftp://h/x"}}, "source.kind"),
    ({"name": "ok", "source": {"kind": "http", "url": "ftp://h/x"}}, "source.url"),
    ({"name": "ok", "source": {"kind": "http", "url": "http://user:pw@h/x.tar"}}, "source.url"),
    ({"name": "ok", "source": {"kind": "http", "url": "http://h/a b.tar"}}, "source.url"),
    ({"name": "ok", "source": {"kind": "http", "url": "http://h:99999/x"}}, "source.url"),
    ({"name": "ok", "source": {"kind": "http", "url": "http://h/x", "extra": 1}}, "source"),
    ({"name": "ok", "source": {"kind": "s3", "bucket": "UPPER"}}, "source.bucket"),
    ({"name": "ok", "source": {"kind": "s3", "bucket": "b-ok", "prefix": "../up"}}, "source.prefix"),
    ({"name": "ok", "source": {"kind": "s3", "bucket": "b-ok", "access_key": "k"}}, "source.access_key"),
    ({"name": "ok", "source": "http://h/x"}, "source"),
    ({"name": "ok", "project": "nlp"}, "project"),
])
def test_bad_dataset_bodies_are_refused_by_field(api, demo, body, field):
    r = api("alice").post("/api/v1/datasets/", {"project": "vision", **body}, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert not Dataset.objects.exists()


def test_a_taken_name_is_a_field_message(api, demo):
    assert _create(api, name="dup").status_code == 201
    again = _create(api, name="dup")
    assert again.status_code == 400 and "already has a dataset" in again.json()["error"]["fields"]["name"][0]


def test_hosts_outside_dataset_source_hosts_are_refused(api, demo, settings):
    settings.DATASET_SOURCE_HOSTS = ["*.example.org"]
    r = _create(api, name="x", source={"kind": "http", "url": "http://169.254.169.254/latest/x.tar"})
    assert r.status_code == 400 and "not an allowed dataset source" in r.json()["error"]["fields"]["source.url"][0]
    assert _create(api, name="y", source={"kind": "http", "url": "https://data.example.org/x.tar"}).status_code == 201


def test_another_tenants_dataset_does_not_exist_for_you(api, demo, http_files):
    theirs = dataset_create(actor=Actor(user=demo.users["charlie"]), project=demo.nlp, name="secret",
                            source={"kind": "http", "url": http_files.put("s.bin", b"s")})
    dataset_version_inspect(theirs.versions.get().pk)
    assert api("alice").get(f"/api/v1/datasets/{theirs.pk}/").status_code == 404
    assert api("alice").post(f"/api/v1/datasets/{theirs.pk}/versions/", {"source": {
        "kind": "http", "url": "http://h/x"}}, format="json").status_code == 404
    assert theirs.pk not in [d["id"] for d in api("alice").get("/api/v1/datasets/").json()["results"]]
    # At submit: the same answer as for a name that exists nowhere.
    spec = {"project": "vision", "image": "gpuportal/busybox:latest", "command": ["true"]}
    refused = api("alice").post("/api/v1/jobs/", {**spec, "datasets": ["secret"]}, format="json")
    nowhere = api("alice").post("/api/v1/jobs/", {**spec, "datasets": ["nosuch"]}, format="json")
    assert refused.status_code == nowhere.status_code == 400
    assert refused.json()["error"]["fields"]["datasets.0"] == ["Project vision has no dataset named 'secret'."]


@pytest.mark.parametrize("refs,key,message", [
    (["tiny@7"], "datasets.0", "has no version 7"),
    (["tiny", "tiny@1"], "datasets.1", "named twice"),
    (["Bad Name"], "datasets.0", "Name a dataset as"),
    (["tiny@x"], "datasets.0", "Name a dataset as"),
])
def test_bad_dataset_references_at_submit(api, demo, http_files, refs, key, message):
    d = dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="tiny",
                       source={"kind": "http", "url": http_files.put("t.bin", b"t")})
    dataset_version_inspect(d.versions.get().pk)
    r = api("alice").post("/api/v1/jobs/", {"project": "vision", "image": "gpuportal/busybox:latest",
                                            "command": ["true"], "datasets": refs}, format="json")
    assert r.status_code == 400 and message in r.json()["error"]["fields"][key][0], r.json()


def test_kvm_jobs_name_datasets_as_docker_jobs_do(api, demo, http_files):
    """The kvm sandbox mounts them over virtio-9p (tests/agents/test_kvm_boot.py): resolved at submit alike."""
    d = dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="tiny",
                       source={"kind": "http", "url": http_files.put("t.bin", b"t")})
    dataset_version_inspect(d.versions.get().pk)
    r = api("alice").post("/api/v1/jobs/", {"project": "vision", "image": "gpuportal/busybox:latest", "sandbox": "kvm",
                                            "command": ["true"], "datasets": ["tiny"]}, format="json")
    assert r.status_code == 201, r.json()
    assert [(x["name"], x["version"]) for x in r.json()["datasets"]] == [("tiny", 1)]


def test_an_upload_is_a_ready_version_served_only_to_a_node_running_it(api, demo, local_artifacts):
    data = tar_archive(gz=False, members={"x.txt": b"uploaded"})
    dataset = _create(api, name="up").json()
    r = api("bob").put(f"/api/v1/datasets/{dataset['id']}/upload/?filename=set.tar", data=data,
                       content_type="application/octet-stream")
    assert r.status_code == 201, r.json()
    assert r.json()["state"] == "ready" and r.json()["size"] == len(data) and r.json()["location"] == "upload:set.tar"
    bad = api("bob").put(f"/api/v1/datasets/{dataset['id']}/upload/?filename=../x", data=b"x",
                         content_type="application/octet-stream")
    assert bad.status_code == 400 and "filename" in bad.json()["error"]["fields"]

    node = agent_client(demo, "gpu-01", gpus="1xH100-80GB")
    other = agent_client(demo, "gpu-02", gpus="1xH100-80GB")
    digest = r.json()["digest"]
    url = f"/api/agent/v1/datasets/{digest}/file"
    assert node.get(url).status_code == 404  # no job of this node names it yet
    job = submit(demo, datasets=["up"], resources={"gpus": 1})
    from portal.jobs.models import Job
    from scheduler.adapter import run_pass

    run_pass()
    job = Job.objects.get(pk=job.pk)
    assert job.node is not None, job.reason_message
    holder, stranger = (node, other) if job.node.name == "gpu-01" else (other, node)
    got = holder.get(url)
    assert got.status_code == 200 and b"".join(got.streaming_content) == data
    assert stranger.get(url).status_code == 404
    from portal.launch import launch_spec

    spec = launch_spec(job.pk, job.node.name)
    assert spec["datasets"][0]["files"][0]["url"] == f"agent:datasets/{digest}/file"


def test_upload_over_the_limit_is_413(api, demo, local_artifacts, settings):
    settings.DATASET_UPLOAD_MAX_MB = 1
    dataset = _create(api, name="big").json()
    r = api("alice").put(f"/api/v1/datasets/{dataset['id']}/upload/?filename=big.bin", data=b"x" * (MB + 1),
                         content_type="application/octet-stream")
    assert r.status_code == 413 and not DatasetVersion.objects.exists()


def test_a_dataset_named_by_an_active_job_is_not_deleted(api, demo, http_files):
    d = dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="used",
                       source={"kind": "http", "url": http_files.put("u.bin", b"u")})
    dataset_version_inspect(d.versions.get().pk)
    job = submit(demo, datasets=["used"])
    assert api("bob").delete(f"/api/v1/datasets/{d.pk}/").status_code == 403  # a member may not
    r = api("alice").delete(f"/api/v1/datasets/{d.pk}/")
    assert r.status_code == 409 and r.json()["error"]["code"] == "dataset_in_use" and str(job.pk) in r.json()[
        "error"]["message"]


def test_nodes_report_their_cached_digests(demo, api):
    node = agent_client(demo, "gpu-01", gpus="1xH100-80GB")
    a, b = "a" * 64, "b" * 64
    reg = node.post("/api/agent/v1/register", {"name": "gpu-01", "cpus": 8, "memory_mb": 1024, "sandbox": "docker",
                                               "gpus": [], "cached_datasets": [b, a, a]}, format="json")
    assert reg.status_code == 200, reg.content
    node.node.refresh_from_db()
    assert node.node.cached_datasets == [a, b]
    assert node.post("/api/agent/v1/heartbeat", {"samples": [], "jobs": []}, format="json").status_code == 200
    node.node.refresh_from_db()
    assert node.node.cached_datasets == [a, b]  # absent: unchanged
    assert node.post("/api/agent/v1/heartbeat", {"cached_datasets": [b]}, format="json").status_code == 200
    node.node.refresh_from_db()
    assert node.node.cached_datasets == [b]
    bad = node.post("/api/agent/v1/heartbeat", {"cached_datasets": ["../etc"]}, format="json")
    assert bad.status_code == 400 and "cached_datasets" in str(bad.json()["error"]["fields"])
    # Operators see them on the node (staff only, as every node field).
    shown = {n["name"]: n for n in api("admin").get("/api/v1/nodes/").json()["results"]}
    assert shown["gpu-01"]["cached_datasets"] == [b]


def test_the_projects_datasets_page_lists_versions(api, demo, http_files):
    d = dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="shown",
                       source={"kind": "http", "url": http_files.put("p.bin", b"page")})
    version = dataset_version_inspect(d.versions.get().pk)
    page = api("dave").get("/projects/vision/datasets/")
    html = page.content.decode()
    assert page.status_code == 200 and "shown@1" in html and "/datasets/shown" in html and "ready" in html
    assert version.digest[:10] in html and http_files.url in html
    assert api("charlie").get("/projects/vision/datasets/").status_code == 404
    assert 'href="/projects/vision/datasets/"' in api("alice").get("/projects/vision/").content.decode()


def test_staging_progress_is_the_jobs_reason(api, demo, http_files):
    """The agent reports staging as a stage of the launch (POST .../progress, stage "staging")."""
    from portal.jobs.models import Job
    from scheduler.adapter import run_pass

    d = dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="big",
                       source={"kind": "http", "url": http_files.put("b.bin", b"b")})
    dataset_version_inspect(d.versions.get().pk)
    node = agent_client(demo, "gpu-01", gpus="1xH100-80GB")
    job = submit(demo, datasets=["big"], resources={"gpus": 1})
    run_pass()
    assert Job.objects.get(pk=job.pk).node.name == "gpu-01"
    node.post(f"/api/agent/v1/jobs/{job.pk}/confirm", {"attempt": 1}, format="json")
    r = node.post(f"/api/agent/v1/jobs/{job.pk}/progress",
                  {"attempt": 1, "stage": "staging", "message": "staging dataset big@1: 43%"}, format="json")
    assert r.status_code == 200, r.content
    assert api("alice").get(f"/api/v1/jobs/{job.pk}/").json()["reason"] == {
        "code": "staging", "message": "staging dataset big@1: 43%"}


def test_a_batch_and_an_array_resolve_datasets_for_every_job(api, demo, http_files):
    from portal.jobs.models import Job

    d = dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="shared",
                       source={"kind": "http", "url": http_files.put("s.bin", b"shared")})
    version = dataset_version_inspect(d.versions.get().pk)
    r = api("alice").post("/api/v1/jobs/batch/", {
        "defaults": {"project": "vision", "image": "gpuportal/busybox:latest", "datasets": ["shared"]},
        "jobs": [{"command": ["true"]}, {"command": ["false"], "datasets": ["shared@1"]}]}, format="json")
    assert r.status_code == 201, r.content
    array = submit(demo, datasets=["shared"], array="0-2")
    jobs = list(Job.objects.filter(pk__in=r.json()["ids"])) + list(array.tasks.all())
    assert len(jobs) == 5 and all(j.datasets == [{"name": "shared", "version": 1, "digest": version.digest,
                                                  "size": 6, "source": http_files.url + "/s.bin"}] for j in jobs)
    bad = api("alice").post("/api/v1/jobs/batch/", {
        "defaults": {"project": "vision", "image": "gpuportal/busybox:latest"},
        "jobs": [{"command": ["true"], "datasets": ["nope"]}]}, format="json")
    assert bad.status_code == 400 and "datasets.0" in str(bad.json()["error"]["fields"]), bad.json()


def test_pending_versions_nobody_reads_are_read_by_the_sweep(api, demo, http_files, settings):
    """A version whose task was lost (a broker outage) is read by the beat's sweep; one a worker is
    reading now is not read twice, unless that reader has been at it past DATASET_INSPECT_STALE_S."""
    from datetime import timedelta

    from django.utils import timezone

    from portal.storage.datasets import dataset_inspect_pending

    d = dataset_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="lost",
                       source={"kind": "http", "url": http_files.put("l.bin", b"lost")})
    version = d.versions.get()
    assert dataset_inspect_pending() == 0  # just made: its own task may still come
    DatasetVersion.objects.filter(pk=version.pk).update(created_at=timezone.now() - timedelta(minutes=5),
                                                        inspect_started_at=timezone.now())
    assert dataset_inspect_pending() == 0 and dataset_version_inspect(version.pk) is None  # being read
    DatasetVersion.objects.filter(pk=version.pk).update(
        inspect_started_at=timezone.now() - timedelta(seconds=settings.DATASET_INSPECT_STALE_S + 1))
    assert dataset_inspect_pending() == 1  # its reader died: read again
    version.refresh_from_db()
    assert version.state == "ready" and version.size == 4 and http_files.requests["/l.bin"] == 1
    assert dataset_inspect_pending() == 0
