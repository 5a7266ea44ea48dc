"""Artifacts straight from the node to an S3-compatible storage (a real SeaweedFS): the portal issues a
presigned PUT URL per file (only to the node that ran the attempt, within the attempt's limits, at a key
it chooses), the node PUTs the bytes there and confirms; a confirm of an object that is not there, or
of another size, is refused. A local storage, presigning off or an older agent keep the relay."""
import hashlib
import urllib.parse
import uuid

import pytest
import requests

from agents import protocol
from portal.nodes.models import Node
from portal.storage.models import Artifact
from tests.jobs.test_logs import node, placed  # noqa: F401 (node gpu-01 and a job placed on it)
from tests.storage.conftest import s3_artifacts
from tests.storage.test_artifacts_api import _node, fetch, put

pytestmark = pytest.mark.django_db


@pytest.fixture
def bucket(settings, seaweedfs, node):
    """The artifacts storage on SeaweedFS below a fresh prefix, and gpu-01's agent speaking 1.6.
    -> a function listing the keys stored there."""
    prefix = f"d-{uuid.uuid4().hex[:12]}"
    settings.STORAGES = {**settings.STORAGES, "artifacts": s3_artifacts(seaweedfs, prefix)}
    settings.ARTIFACTS_UPLOAD_PRESIGN_S = 120
    Node.objects.filter(pk=node.node.pk).update(protocol_version=protocol.PROTOCOL_VERSION)

    def keys():
        listing = seaweedfs.client().list_objects_v2(Bucket=seaweedfs.bucket, Prefix=prefix + "/").get("Contents", [])
        return sorted(o["Key"].removeprefix(prefix + "/") for o in listing)
    return keys


def ask(node, job, path, size, attempt=1):
    return node.post(f"/api/agent/v1/jobs/{job.pk}/artifacts/uploads", format="json",
                     data={"attempt": attempt, "path": path, "size": size})


def confirm(node, job, path, body: bytes, size=None, attempt=1):
    return node.post(f"/api/agent/v1/jobs/{job.pk}/artifacts/confirm", format="json", data={
        "attempt": attempt, "path": path, "size": len(body) if size is None else size,
        "sha256": hashlib.sha256(body).hexdigest()})


def upload(node, job, path, body: bytes):
    """The agent's way: a URL, the bytes to the storage (without the portal's token), a confirm."""
    offer = ask(node, job, path, len(body))
    assert offer.status_code == 200 and offer.json()["relay"] is False, offer.content
    assert requests.put(offer.json()["url"], data=body, timeout=30).status_code == 200
    return confirm(node, job, path, body)


def test_a_file_goes_straight_to_the_storage_and_is_listed_and_downloaded(node, placed, api, bucket, seaweedfs):
    body = bytes(range(256)) * 2048
    offer = ask(node, placed, "ckpt/model.bin", len(body))
    assert offer.status_code == 200, offer.content
    url = offer.json()["url"]
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert url.startswith(seaweedfs.endpoint + "/") and query["X-Amz-Expires"] == ["120"]
    assert offer.json()["method"] == "PUT" and node.secret not in url
    # The signature covers the key the portal chose: the URL does not write anywhere else.
    assert requests.put(url.replace("model.bin", "other.bin"), data=body, timeout=30).status_code == 403
    assert requests.put(url, data=body, timeout=30).status_code == 200
    assert bucket() == [f"jobs/{placed.pk}/1/ckpt/model.bin"]
    r = confirm(node, placed, "ckpt/model.bin", body)
    assert r.status_code == 201 and r.json() == {"path": "ckpt/model.bin", "size": len(body),
                                                 "sha256": hashlib.sha256(body).hexdigest()}
    listing = api("dave").get(f"/api/v1/jobs/{placed.pk}/artifacts/").json()
    assert [(a["path"], a["size"]) for a in listing] == [("ckpt/model.bin", len(body))]
    assert fetch(api("dave"), f"/api/v1/jobs/{placed.pk}/artifacts/{listing[0]['id']}/", "s3") == body


def test_a_local_storage_presigning_off_or_an_older_agent_keep_the_relay(node, placed, settings, bucket, tmp_path):
    settings.ARTIFACTS_UPLOAD_PRESIGN_S = 0
    assert ask(node, placed, "a.txt", 1).json() == {"relay": True}
    settings.ARTIFACTS_UPLOAD_PRESIGN_S = 120
    for old in ("", "1.5"):
        Node.objects.filter(pk=node.node.pk).update(protocol_version=old)
        assert ask(node, placed, "a.txt", 1).json() == {"relay": True}
        assert confirm(node, placed, "a.txt", b"x").status_code == 400
        assert put(node, placed, "a.txt", b"x").status_code == 201  # the relay still takes it
    assert bucket() == [f"jobs/{placed.pk}/1/a.txt"]
    Node.objects.filter(pk=node.node.pk).update(protocol_version=protocol.PROTOCOL_VERSION)
    settings.STORAGES = {**settings.STORAGES, "artifacts": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path / "a")}}}
    assert ask(node, placed, "a.txt", 1).json() == {"relay": True}


def test_outsiders_and_other_nodes_get_no_url(node, placed, demo, api, bucket):
    other = _node(demo, "gpu-02")
    Node.objects.filter(name="gpu-02").update(protocol_version=protocol.PROTOCOL_VERSION)
    assert ask(other, placed, "x", 1).status_code == 404
    assert ask(node, placed, "x", 1, attempt=2).status_code == 404  # an attempt that never was
    assert node.post("/api/agent/v1/jobs/999999/artifacts/uploads", format="json",
                     data={"attempt": 1, "path": "x", "size": 1}).status_code == 404
    assert api("alice").post(f"/api/agent/v1/jobs/{placed.pk}/artifacts/uploads", format="json",
                             data={"attempt": 1, "path": "x", "size": 1}).status_code in (401, 403)
    # Uploaded by the right node, confirmed by another: refused, nothing recorded.
    assert upload(node, placed, "x", b"x").status_code == 201
    assert confirm(other, placed, "y", b"y").status_code == 404
    assert list(Artifact.objects.values_list("path", flat=True)) == ["x"]


@pytest.mark.parametrize("data, field", [({"path": "../x", "size": 1}, "path"), ({"path": "/etc/passwd", "size": 1}, "path"),
                                         ({"path": "x", "size": -1}, "size"), ({"path": "x"}, "size"),
                                         ({"path": "x", "size": "1e9"}, "size")])
def test_bad_requests_name_the_field(node, placed, bucket, data, field):
    r = node.post(f"/api/agent/v1/jobs/{placed.pk}/artifacts/uploads", format="json", data={"attempt": 1, **data})
    assert r.status_code == 400 and field in r.json()["error"]["fields"], r.content


def test_a_confirm_of_a_missing_or_different_object_is_refused(node, placed, bucket):
    r = confirm(node, placed, "never.bin", b"never uploaded")
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_uploaded", r.content
    offer = ask(node, placed, "m.bin", 10).json()
    assert requests.put(offer["url"], data=b"y" * 11, timeout=30).status_code == 200  # not the size announced
    r = confirm(node, placed, "m.bin", b"y" * 10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "size_mismatch" and "size" in r.json()["error"]["fields"]
    assert bucket() == [] and not Artifact.objects.exists()  # the odd object is deleted
    r = node.post(f"/api/agent/v1/jobs/{placed.pk}/artifacts/confirm", format="json",
                  data={"attempt": 1, "path": "m.bin", "size": 10, "sha256": "z" * 64})
    assert r.status_code == 400 and "sha256" in r.json()["error"]["fields"]


def test_the_attempts_limits_hold_when_issued_and_when_confirmed(node, placed, settings, bucket):
    settings.ARTIFACTS_MAX_MB = 1
    settings.ARTIFACTS_MAX_FILES = 3
    r = ask(node, placed, "big.bin", 1024 * 1024 + 1)
    assert r.status_code == 413 and r.json()["error"]["code"] == "artifacts_too_large", r.content
    # Two URLs issued against the same room: the second confirm finds it taken, and its object goes.
    first, second = ask(node, placed, "a.bin", 700_000).json(), ask(node, placed, "b.bin", 700_000).json()
    assert requests.put(first["url"], data=b"a" * 700_000, timeout=30).status_code == 200
    assert requests.put(second["url"], data=b"b" * 700_000, timeout=30).status_code == 200
    assert confirm(node, placed, "a.bin", b"a" * 700_000).status_code == 201
    r = confirm(node, placed, "b.bin", b"b" * 700_000)
    assert r.status_code == 413 and r.json()["error"]["code"] == "artifacts_too_large"
    assert bucket() == [f"jobs/{placed.pk}/1/a.bin"]
    assert upload(node, placed, "c", b"c").status_code == 201
    assert upload(node, placed, "d", b"d").status_code == 201
    r = ask(node, placed, "e", 1)
    assert r.status_code == 413 and r.json()["error"]["code"] == "artifacts_too_many"
    assert sorted(Artifact.objects.values_list("path", flat=True)) == ["a.bin", "c", "d"]


@pytest.mark.django_db(transaction=True)
def test_the_agent_uploads_straight_to_the_storage_and_falls_back_to_the_relay(live_server, demo, settings,
                                                                               seaweedfs, sent, tmp_path, request):
    """agents.artifacts.upload with the real PortalClient against the live portal: a 1.6 agent's files go
    straight to SeaweedFS; where the storage is out of the node's reach they go through the portal."""
    from agents.artifacts import Upload
    from agents.artifacts import upload as agent_upload
    from agents.client import PortalClient
    from portal.core.context import Actor
    from portal.jobs.services import job_submit
    from portal.nodes.services import node_add
    from scheduler.adapter import run_pass

    prefix = f"a-{uuid.uuid4().hex[:12]}"
    settings.STORAGES = {**settings.STORAGES, "artifacts": s3_artifacts(seaweedfs, prefix)}
    settings.ARTIFACTS_UPLOAD_PRESIGN_S = 120
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    Node.objects.filter(name="gpu-01").update(protocol_version=protocol.PROTOCOL_VERSION)
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})
    run_pass()
    outputs = tmp_path / "outputs"
    (outputs / "sub").mkdir(parents=True)
    (outputs / "model.bin").write_bytes(b"w" * 300_000)
    (outputs / "sub" / "empty").write_bytes(b"")
    client = PortalClient(live_server.url, secret, retries=0)
    request.addfinalizer(client.session.close)  # no kept-alive connection holds a server thread (and its database)
    state = Upload()
    assert agent_upload(client, str(job.pk), 1, outputs, state) == ""
    assert (state.files, state.direct, state.relay) == (2, 2, False)
    rows = {a.path: (a.size, a.sha256) for a in Artifact.objects.filter(job=job)}
    assert rows == {"model.bin": (300_000, hashlib.sha256(b"w" * 300_000).hexdigest()),
                    "sub/empty": (0, hashlib.sha256(b"").hexdigest())}

    # The storage's address in the URLs does not answer from this node: the relay takes the files.
    unreachable = s3_artifacts(seaweedfs, prefix)
    unreachable["OPTIONS"].update(custom_domain="127.0.0.1:9", url_protocol="http:")  # only the URLs say so
    settings.STORAGES = {**settings.STORAGES, "artifacts": unreachable}
    (outputs / "late.txt").write_bytes(b"late")
    assert agent_upload(client, str(job.pk), 1, outputs, state) == ""
    assert state.relay and (state.files, state.direct) == (3, 2)
    assert Artifact.objects.get(job=job, path="late.txt").size == 4
