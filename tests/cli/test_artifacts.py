"""gpuctl artifacts list and get against a live portal (artifacts stored as the agent's upload leaves them)."""
import json

import pytest

from portal.core.context import Actor
from portal.jobs.services import job_submit
from portal.storage.artifacts import artifact_put
from scheduler.adapter import run_pass
from tests.storage.conftest import seaweedfs  # noqa: F401 (SeaweedFS, for the s3 case)

IMAGE = "gpuportal/busybox:latest"


class Body:
    def __init__(self, data: bytes):
        self.data = data

    def read(self, n=-1):
        out, self.data = self.data[:n], self.data[n:]
        return out


@pytest.fixture(params=["local", "s3"])
def ended(request, portal, settings, tmp_path):
    """Alice's job with two attempts' artifacts, uploaded as gpu-01's agent would, kept in a local folder
    and on SeaweedFS (whose downloads are redirects to presigned URLs, fetched without the token)."""
    from portal.jobs.models import Job

    if request.param == "s3":
        from tests.storage.conftest import s3_artifacts

        server = request.getfixturevalue("seaweedfs")
        settings.STORAGES = {**settings.STORAGES, "artifacts": s3_artifacts(server, f"cli-{tmp_path.name}")}
    else:
        settings.STORAGES = {**settings.STORAGES, "artifacts": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "store")}}}
    job, _ = job_submit(actor=Actor(user=portal.users["alice"]), data={
        "project": "vision", "name": "j", "image": IMAGE, "command": ["true"], "resources": {"gpus": 1}})
    run_pass()
    job.refresh_from_db()
    node = job.node or job.allocations.first().gpu.node

    def put(attempt, path, data):
        artifact_put(node=node, job_id=str(job.pk), attempt=attempt, path=path, stream=Body(data), length=len(data))

    put(1, "old.txt", b"attempt one\n")
    Job.objects.filter(pk=job.pk).update(attempt=2)
    put(2, "model/weights.bin", b"\x00\x01" * 1000)
    put(2, "metrics.json", b'{"loss": 0.5}\n')
    return job


def test_list_and_get_the_last_attempts_files(ended, gpuctl, tmp_path, monkeypatch):
    listed = gpuctl("artifacts", "list", ended.pk)
    assert listed.exit_code == 0, listed.stderr
    assert "model/weights.bin" in listed.stdout and "old.txt" in listed.stdout
    rows = json.loads(gpuctl("artifacts", "list", ended.pk, "--attempt", "2", "-o", "json").stdout)
    assert sorted(r["path"] for r in rows) == ["metrics.json", "model/weights.bin"]

    monkeypatch.chdir(tmp_path)
    got = gpuctl("artifacts", "get", ended.pk)
    assert got.exit_code == 0, got.stderr
    folder = tmp_path / f"job-{ended.pk}"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "metrics.json", "model/weights.bin"]
    assert (folder / "model" / "weights.bin").read_bytes() == b"\x00\x01" * 1000
    one = gpuctl("artifacts", "get", ended.pk, "old.txt", "--attempt", "1", "-d", tmp_path / "first")
    assert one.exit_code == 0, one.stderr
    assert (tmp_path / "first" / "old.txt").read_bytes() == b"attempt one\n"


def test_errors(ended, portal, gpuctl, monkeypatch, tmp_path):
    missing = gpuctl("artifacts", "get", ended.pk, "nope.txt", "-d", tmp_path / "x")
    assert missing.exit_code == 2 and "no artifact 'nope.txt' in attempt 2" in missing.stderr
    assert not (tmp_path / "x").exists()
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["charlie"])
    outsider = gpuctl("artifacts", "list", ended.pk)
    assert outsider.exit_code == 4 and "not found" in outsider.stderr
