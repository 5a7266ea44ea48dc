"""Artifacts end to end on the real parts: the portal (live server, PostgreSQL), the scheduler's Celery
worker, a real agent process with the docker sandbox, and SeaweedFS as the artifacts storage. What a
job writes to /outputs is uploaded when it ends, however it ends (succeeded, failed, timeout,
cancelled), and downloads through the jobs API; a symlink out of /outputs is never followed."""
import uuid

import pytest

from agents.artifacts import scan
from tests.e2e_agent.test_stack import Stack
from tests.storage.conftest import s3_artifacts
from tests.storage.test_artifacts_api import fetch

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def stack(live_server, tmp_path, demo, settings, seaweedfs):
    settings.NODE_HEARTBEAT_INTERVAL_S = 1.0
    settings.AGENT_LEASE_S = 4.0
    settings.NODE_TIMEOUT_S = 6.0
    settings.LAUNCH_RESEND_S = 5
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    settings.STORAGES = {**settings.STORAGES, "artifacts": s3_artifacts(seaweedfs, prefix)}
    s = Stack(live_server, tmp_path, demo)
    s.env["GPUPORTAL_AGENT_STATE_DIR"] = str(tmp_path / "agent-state")
    s.bucket_keys = lambda: sorted(o["Key"].removeprefix(prefix + "/") for o in seaweedfs.client().list_objects_v2(
        Bucket=seaweedfs.bucket, Prefix=prefix + "/").get("Contents", []))
    try:
        s.start_all()
        yield s
    finally:
        s.close()


def artifacts(s, job_id) -> dict[str, bytes]:
    listing = s.client.get(f"/api/v1/jobs/{job_id}/artifacts/")
    assert listing.status_code == 200, listing.content
    out = {}
    for a in listing.json():  # each a redirect to a presigned URL of SeaweedFS
        out[a["path"]] = fetch(s.client, f"/api/v1/jobs/{job_id}/artifacts/{a['id']}/", "s3")
    return out


WRITE = ("echo result-$GPUPORTAL_JOB_ID > /outputs/result.txt; mkdir -p /outputs/sub; "
         "head -c 300000 /dev/zero > /outputs/sub/zeros.bin; ln -s /etc/passwd /outputs/passwd; "
         "ln -s / /outputs/root; [ \"$GPUPORTAL_OUTPUTS_DIR\" = /outputs ] && id -u > /outputs/uid")


def test_outputs_are_uploaded_however_the_job_ends(stack, demo, tmp_path):
    s = stack
    ok = s.submit(command=["sh", "-c", WRITE])
    failed = s.submit(command=["sh", "-c", "echo partial > /outputs/partial.txt; exit 3"])
    timed_out = s.submit(command=["sh", "-c", "echo before > /outputs/checkpoint.txt; sleep 300"], time_limit=3)
    cancelled = s.submit(command=["sh", "-c", "echo cancelled-too > /outputs/c.txt; sleep 300"])

    job = s.wait_state(ok, "succeeded")
    assert artifacts(s, ok) == {"result.txt": f"result-{ok}\n".encode(), "sub/zeros.bin": b"\0" * 300000,
                                "uid": f"{2000000 + demo.vision.pk}\n".encode()}
    # The symlinks were skipped (never read), and the job's message says so.
    ended = [e["message"] for e in job["events"] if e["state"] == "succeeded"]
    assert ended == ["outputs: 2 symlinks (never followed) not uploaded (passwd, root)"], job["events"]

    job = s.wait_state(failed, "failed")
    assert job["exit_code"] == 3 and artifacts(s, failed) == {"partial.txt": b"partial\n"}
    s.wait_state(timed_out, "timeout")
    assert artifacts(s, timed_out) == {"checkpoint.txt": b"before\n"}

    s.wait_state(cancelled, "running")
    from tests.procs import wait_for

    # Written once it runs: wait for the file before cancelling.
    wait_for(lambda: any(p.name == "c.txt" for p in (tmp_path / "agent-state").rglob("c.txt")), 30, "c.txt")
    assert s.client.post(f"/api/v1/jobs/{cancelled}/cancel/").status_code == 202
    s.wait_state(cancelled, "cancelled")
    wait_for(lambda: artifacts(s, cancelled) == {"c.txt": b"cancelled-too\n"}, 30,
             f"the cancelled job's outputs; agent log:\n{s.log('agent')[-3000:]}")

    # In the bucket, under jobs/<id>/<attempt>/; on the node, the outputs folders are gone once reported.
    assert f"jobs/{ok}/1/result.txt" in s.bucket_keys()
    wait_for(lambda: not [p for p in (tmp_path / "agent-state").rglob("outputs/*")], 30, "the outputs folders to go")


def test_scan_never_follows_a_link_out(tmp_path):
    """The agent reads the outputs folder as root: links out of it (to a file, to a folder) and special
    files are skipped, and a folder replaced by a link is never entered."""
    import os

    top = tmp_path / "outputs"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f.txt").write_text("x")
    (tmp_path / "secret").write_text("secret")
    os.symlink(tmp_path / "secret", top / "link")
    os.symlink(tmp_path, top / "a" / "up")
    os.mkfifo(top / "fifo")
    (top / "bad\udcff".encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")).write_text("y")
    found = scan(top)
    assert found.files == [("a/b/f.txt", 1)]
    assert found.skipped["symlinks (never followed)"] == ["a/up", "link"]
    assert found.skipped["special files"] == ["fifo"]
    assert len(found.skipped["names not UTF-8"]) == 1
    # The top itself a link: nothing at all.
    os.symlink(tmp_path, tmp_path / "top-link")
    with pytest.raises(OSError):
        scan(tmp_path / "top-link")


def test_an_empty_outputs_folder_is_told_apart_without_a_scan(tmp_path):
    """The agent skips the upload (and its thread) for a job that wrote no outputs: only a folder with
    nothing in it, or none, counts as empty; a link, even to an empty folder, goes to ``scan``."""
    import os

    from agents.artifacts import empty

    top = tmp_path / "outputs"
    top.mkdir()
    assert empty(top) and empty(tmp_path / "missing")
    (top / "sub").mkdir()
    assert not empty(top)  # an empty folder inside is still something to look at
    (tmp_path / "hollow").mkdir()
    os.symlink(tmp_path / "hollow", tmp_path / "link")
    assert not empty(tmp_path / "link")
