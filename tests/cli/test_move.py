"""gpuctl move: operators requeue a running job elsewhere (docs/jobs.md, "Checkpoints")."""
import json

from scheduler.adapter import run_pass
from tests.conftest import make_token

from tests.conftest import submit


def test_an_operator_moves_a_running_checkpointing_job(portal, gpuctl, monkeypatch):
    job = submit(portal, resources={"gpus": 1}, checkpoint={"grace_s": 60})
    run_pass()
    result = gpuctl("move", job.pk)
    assert result.exit_code == 3 and "Only site staff move jobs" in result.stderr  # alice is no operator
    monkeypatch.setenv("GPUCTL_TOKEN", make_token(portal.users["admin"]))
    result = gpuctl("move", job.pk, "-o", "json")
    assert result.exit_code == 0, result.stderr
    (doc,) = json.loads(result.stdout)
    assert (doc["state"], doc["attempt"], doc["reason"]["code"]) == ("queued", 2, "moved")
    assert "SIGUSR1 and 60 s to checkpoint" in doc["reason"]["message"]
    result = gpuctl("move", job.pk)  # queued now: nothing to move
    assert result.exit_code == 5 and "only a job that holds GPUs can be moved" in result.stderr
