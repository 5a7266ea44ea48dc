"""End to end: portal, scheduler worker and a real agent process with the docker sandbox; a job of
vision writes into its volume and the file downloads through the API."""
import pytest

from tests.e2e_agent.test_stack import Stack


@pytest.fixture
def stack(live_server, tmp_path, demo, settings):
    settings.NODE_HEARTBEAT_INTERVAL_S = 1.0
    s = Stack(live_server, tmp_path, demo)
    # The agent's view of the operator's tree: the same path as the portal's (one machine here).
    s.env["GPUPORTAL_VOLUMES_ROOT"] = str(settings.VOLUMES_ROOT)
    try:
        s.start_all()
        yield s
    finally:
        s.close()


def test_a_job_writes_its_volume_and_the_result_downloads(stack, api, demo, settings):
    alice = api("alice")
    volume = alice.post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json").json()
    job_id = stack.submit(volumes=[{"name": "x"}], command=[
        "sh", "-c", 'echo result > /data/x/out.txt && echo state > "$GPUPORTAL_CHECKPOINT_DIR/step" && id -u'])
    job = stack.wait_state(job_id, {"succeeded", "failed"})
    assert job["state"] == "succeeded", (job, stack.log("agent")[-3000:])
    download = api("dave").get(f"/api/v1/volumes/{volume['id']}/download/?path=out.txt")
    assert download.status_code == 200 and b"".join(download.streaming_content) == b"result\n"
    listing = alice.get(f"/api/v1/volumes/{volume['id']}/files/?path=.checkpoints/{job_id}").json()
    assert [e["name"] for e in listing["entries"]] == ["step"]
    assert api("charlie").get(f"/api/v1/volumes/{volume['id']}/download/?path=out.txt").status_code == 404
