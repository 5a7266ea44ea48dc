"""Datasets end to end on the real parts: the portal (live server, PostgreSQL), the scheduler's Celery
worker, a real agent process with the docker sandbox and its dataset cache, and a loopback HTTP server
as the source. A job reads its dataset read-only at /datasets/<name>; the next job on the node finds it
cached (no second download) and the node reports the digest; a source that changed fails the job saying
so; a version larger than the node's cache fails it with the reason; a cache full of what running jobs
read sends the job back to the queue instead; a kvm job reads its dataset and leaves artifacts too."""
import os
import sys

import pytest

from portal.nodes.models import Node
from portal.storage.models import DatasetVersion
from tests.e2e_agent.test_stack import Stack
from tests.httpfiles import tar_archive
from tests.procs import wait_for
from tests.storage.test_artifacts_api import fetch

pytestmark = pytest.mark.django_db(transaction=True)


def _start(s: Stack) -> None:
    """The stack and the portal's worker for the default queue (it reads new dataset versions)."""
    s.start_all()
    s.start("default", [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "default", "-P", "solo",
                        "-n", f"default-{s.name}@%h", "--loglevel", "INFO"])
    wait_for(lambda: "ready." in s.log("default"), 60, "the portal's default worker")


@pytest.fixture
def stack(live_server, tmp_path, demo, settings):
    settings.NODE_HEARTBEAT_INTERVAL_S = 1.0
    settings.AGENT_LEASE_S = 4.0
    settings.NODE_TIMEOUT_S = 6.0
    settings.LAUNCH_RESEND_S = 5
    s = Stack(live_server, tmp_path, demo)
    s.env["GPUPORTAL_AGENT_STATE_DIR"] = str(tmp_path / "agent-state")
    s.env["GPUPORTAL_DATASET_CACHE_MB"] = "1"
    try:
        _start(s)
        yield s
    finally:
        s.close()


def _dataset(s, name, url) -> DatasetVersion:
    """A dataset whose version 1 the portal's own worker reads (storage.dataset_inspect on the default queue)."""
    r = s.client.post("/api/v1/datasets/", {"project": "vision", "name": name, "source": {"kind": "http", "url": url}},
                      format="json")
    assert r.status_code == 201, r.content
    shown = wait_for(lambda: (d := s.client.get(f"/api/v1/datasets/{r.json()['id']}/").json())["versions"][0][
        "state"] != "pending" and d, 60, f"the portal's worker to read {name}; its log:\n{s.log('default')[-3000:]}")
    assert shown["versions"][0]["state"] == "ready", shown
    return DatasetVersion.objects.get(dataset_id=r.json()["id"], version=1)


READ = ("cat /datasets/tiny/train/a.txt; ls /datasets; (touch /datasets/tiny/x 2>/dev/null && echo writable) "
        "|| echo read-only")


def test_jobs_read_cached_datasets_and_bad_ones_fail_with_reasons(stack, http_files):
    s = stack
    tiny = _dataset(s, "tiny", http_files.put("tiny.tar.gz", tar_archive({"train/a.txt": b"hello dataset\n"})))
    first = s.submit(command=["sh", "-c", READ], datasets=["tiny"])
    s.wait_state(first, "succeeded")
    logs = s.client.get(f"/api/v1/jobs/{first}/logs/").json()["data"]
    assert logs == "hello dataset\ntiny\nread-only\n", logs
    # The node reports what its cache holds; the portal keeps it for the scheduler.
    wait_for(lambda: Node.objects.get(name=s.name).cached_datasets == [tiny.digest], 30, "the node's cached digests")

    second = s.submit(command=["sh", "-c", READ], datasets=["tiny@1"])
    s.wait_state(second, "succeeded")
    assert http_files.requests["/tiny.tar.gz"] == 2  # the portal's read, then one node download for both jobs

    # The source changed after the version was made: the job fails saying so; nothing is cached.
    drift = _dataset(s, "drift", http_files.put("drift.bin", b"original bytes"))
    http_files.put("drift.bin", b"tampered bytes")
    job = s.wait_state(s.submit(command=["true"], datasets=["drift"]), "failed")
    assert "checksum mismatch on drift.bin" in job["reason"]["message"], job
    assert drift.digest not in Node.objects.get(name=s.name).cached_datasets

    # Larger than this node's whole cache (1 MB): refused with the reason, and the agent carries on.
    big = b"x" * (2 * 1024 * 1024)
    _dataset(s, "big", http_files.put("big.bin", big))
    job = s.wait_state(s.submit(command=["true"], datasets=["big"]), "failed")
    assert "does not fit in this node's dataset cache (limit 1.0 MB)" in job["reason"]["message"], job
    s.wait_state(s.submit(command=["true"], datasets=["tiny"]), "succeeded")


def test_a_node_whose_cache_is_held_by_running_jobs_requeues_the_job_without_failing_it(stack, http_files, settings):
    """The node's cache (1 MB) is full of what a running job reads: a job naming another dataset is
    not failed there but requeued (no failure counted: one attempt allowed), with the reason, kept off
    that node a while; once the room is back and the while is over it runs there."""
    settings.JOB_MAX_ATTEMPTS = 1
    settings.SCHEDULER_NOT_STARTABLE_AVOID_S = 4
    s = stack
    _dataset(s, "held", http_files.put("held.bin", b"h" * 700 * 1024))
    _dataset(s, "other", http_files.put("other.bin", b"o" * 600 * 1024))
    holder = s.submit(command=["sleep", "300"], datasets=["held"])
    s.wait_state(holder, "running")
    job_id = s.submit(command=["sh", "-c", "wc -c < /datasets/other/other.bin"], datasets=["other"])
    requeued = wait_for(lambda: (j := s.job(job_id))["attempt"] >= 2 and j, 60,
                        f"job {job_id} to be requeued; agent log:\n{s.log('agent')[-3000:]}")
    assert requeued["state"] in ("queued", "assigned", "starting"), requeued
    moved = [e for e in requeued["events"] if e["state"] == "queued" and "Not startable" in e["message"]]
    assert moved and f"dataset cache full on node {s.name}" in moved[0]["message"], requeued["events"]
    assert "failed" not in [e["state"] for e in requeued["events"]]
    assert s.client.post(f"/api/v1/jobs/{holder}/cancel/").status_code == 202
    done = s.wait_state(job_id, {"succeeded", "failed", "node_fail"}, timeout=120)
    assert done["state"] == "succeeded", done
    logs = s.client.get(f"/api/v1/jobs/{job_id}/logs/").json()["data"]
    assert logs.strip() == str(600 * 1024), logs


@pytest.fixture
def kvm_stack(live_server, tmp_path, demo, settings):
    """The same parts with the kvm sandbox (libvirtd, domain type qemu here): its state folder outside
    pytest's 0700 tmp_path, since each VM's QEMU (a uid of its own) must reach the dataset cache."""
    import shutil
    import tempfile

    settings.NODE_HEARTBEAT_INTERVAL_S = 1.0
    settings.STORAGES = {**settings.STORAGES, "artifacts": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path / "art")}}}
    state = tempfile.mkdtemp(prefix="gpuportal-kvm-datasets-")
    os.chmod(state, 0o711)
    s = Stack(live_server, tmp_path, demo, sandbox="kvm")
    s.env["GPUPORTAL_AGENT_STATE_DIR"] = state
    s.env["GPUPORTAL_DATASET_CACHE_MB"] = "1"
    try:
        _start(s)
        yield s
    finally:
        s.close()
        shutil.rmtree(state, ignore_errors=True)


def test_a_kvm_job_reads_its_dataset_read_only_and_its_outputs_become_artifacts(kvm_stack, http_files):
    """In a VM: the dataset from the node's cache at /datasets/<name> over virtio-9p, read-only; what
    the job writes to /outputs is uploaded as the attempt's artifacts when it ends."""
    s = kvm_stack
    _dataset(s, "tiny", http_files.put("tiny.tar.gz", tar_archive({"train/a.txt": b"hello dataset\n"})))
    job_id = s.submit(sandbox="kvm", datasets=["tiny"], command=["sh", "-c", READ + (
        "; mkdir /outputs/sub && cp /datasets/tiny/train/a.txt /outputs/sub/copy.txt && echo ok > /outputs/r.txt")])
    job = s.wait_state(job_id, {"succeeded", "failed"}, timeout=240)
    assert job["state"] == "succeeded", (job, s.log("agent")[-3000:])
    logs = wait_for(lambda: (r := s.client.get(f"/api/v1/jobs/{job_id}/logs/").json()["data"]).endswith("read-only\n")
                    and r, 30, "the log tail")
    assert logs == "hello dataset\ntiny\nread-only\n", logs
    listing = s.client.get(f"/api/v1/jobs/{job_id}/artifacts/").json()
    got = {a["path"]: fetch(s.client, f"/api/v1/jobs/{job_id}/artifacts/{a['id']}/", "local") for a in listing}
    assert got == {"r.txt": b"ok\n", "sub/copy.txt": b"hello dataset\n"}, got
