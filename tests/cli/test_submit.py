"""gpuctl submit: flags and spec files, the API's field messages, --watch until the job ends."""
import json
import os
import subprocess
import sys
from pathlib import Path

from portal.jobs.models import Job, JobState
from portal.core.context import Actor
from portal.jobs.states import transition
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import IMAGE, submit
from tests.procs import wait_for

from .conftest import polled_again

REPO = Path(__file__).resolve().parents[2]


def test_submit_prints_the_id_and_how_to_watch_logs_and_cancel(portal, gpuctl):
    result = gpuctl("submit", "-p", "vision", "--name", "train", "--image", IMAGE, "--gpus", "2",
                    "--time-limit", "2h", "-e", "SEED=1", "--", "python", "train.py", "--lr", "3e-4")
    assert result.exit_code == 0, result.stderr
    job = Job.objects.get()
    assert (job.name, job.gpus, job.time_limit_s, job.env) == ("train", 2, 7200, {"SEED": "1"})
    assert job.command == ["python", "train.py", "--lr", "3e-4"]
    assert f"Submitted job {job.pk} " in result.stdout
    for hint in (f"gpuctl show {job.pk}", f"gpuctl logs -f {job.pk}", f"gpuctl cancel {job.pk}"):
        assert hint in result.stdout


def test_flags_override_the_spec_file(portal, gpuctl, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("project: vision\nname: from-file\nimage: gpuportal/busybox:latest\n"
                    "command: python train.py --epochs 3\nresources: {gpus: 1, memory_mb: 8192}\n"
                    "env: {SEED: 1, MODE: fast}\npriority: low\n")
    result = gpuctl("submit", "-f", spec, "--gpus", "4", "--priority", "high", "-e", "MODE=slow", "-o", "json")
    assert result.exit_code == 0, result.stderr
    body = json.loads(result.stdout)
    job = Job.objects.get(pk=body["id"])
    assert job.name == "from-file" and job.command == ["python", "train.py", "--epochs", "3"]
    assert (job.gpus, job.memory_mb, job.priority) == (4, 8192, "high")
    assert job.env == {"SEED": "1", "MODE": "slow"}


def test_idempotency_key_returns_the_first_job(portal, gpuctl):
    args = ("submit", "-p", "vision", "--image", IMAGE, "--idempotency-key", "run-42", "-o", "json", "--", "true")
    first, second = gpuctl(*args), gpuctl(*args)
    assert json.loads(first.stdout)["id"] == json.loads(second.stdout)["id"]
    assert Job.objects.count() == 1


def test_spec_over_quota_prints_the_field_message_and_exits_2(portal, gpuctl):
    result = gpuctl("submit", "-p", "vision", "--name", "big", "--image", IMAGE, "--gpus", "17", "--", "true")
    assert result.exit_code == 2
    assert "resources.gpus: 17 exceeds the project limit of 16." in result.stderr
    assert result.stdout == "" and not Job.objects.exists()


def test_unreadable_spec_file_exits_2(portal, gpuctl, tmp_path):
    bad = tmp_path / "spec.yaml"
    bad.write_text("- just\n- a list\n")
    result = gpuctl("submit", "-f", bad)
    assert result.exit_code == 2 and "expected a mapping" in result.stderr


def test_viewer_may_not_submit_exit_3(portal, gpuctl, monkeypatch):
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["dave"])
    result = gpuctl("submit", "-p", "vision", "--image", IMAGE, "--", "true")
    assert result.exit_code == 3
    assert "does not allow submitting jobs" in result.stderr


def test_watch_prints_each_change_and_the_queue_reason_until_success(portal, gpuctl, requests_seen, drive):
    blocker = submit(portal, resources={"gpus": 8})
    run_pass()  # the blocker takes all 8 GPUs: the watched job will have to wait

    def the_cluster():
        job = wait_for(lambda: Job.objects.filter(name="train").first(), what="the submit")
        detail = f"jobs/{job.pk}/"
        polled_again(requests_seen, detail)
        run_pass()  # still no room: a reason and a queue position
        polled_again(requests_seen, detail)
        transition(blocker.pk, to=JobState.SUCCEEDED, from_states={JobState.ASSIGNED}, exit_code=0)
        run_pass()  # now it fits
        polled_again(requests_seen, detail)
        transition(job.pk, to=JobState.RUNNING, from_states={JobState.ASSIGNED})
        polled_again(requests_seen, detail)
        transition(job.pk, to=JobState.SUCCEEDED, from_states={JobState.RUNNING}, exit_code=0)

    driver = drive(the_cluster)
    result = gpuctl("submit", "-p", "vision", "--name", "train", "--image", IMAGE, "--gpus", "2", "--watch",
                    "--interval", "0.05", "--timeout", "60", "--", "python", "train.py")
    driver.join(30)
    assert result.exit_code == 0, result.output
    job = Job.objects.get(name="train")
    job_lines = [line for line in result.stdout.splitlines() if f"  job {job.pk}  " in line]
    states = [line.split()[3] for line in job_lines]
    assert states[0] == "queued" and states[-1] == "succeeded"
    assert states.index("assigned") < states.index("running") < states.index("succeeded")
    waiting = next(line for line in job_lines if "queue position 1: " in line)
    assert "GPU" in waiting  # the scheduler's reason, as the API gives it
    assert "exit code 0" in job_lines[-1]


def test_watch_as_a_subprocess_exits_1_when_the_job_fails(portal, drive, tmp_path):
    def the_cluster():
        job = wait_for(lambda: Job.objects.filter(name="crash").first(), what="the submit")
        run_pass()
        transition(job.pk, to=JobState.RUNNING, from_states={JobState.ASSIGNED})
        transition(job.pk, to=JobState.FAILED, from_states={JobState.RUNNING}, exit_code=3,
                   reason_code="exit", reason_message="The command exited with 3.")

    driver = drive(the_cluster)
    env = {**os.environ, "GPUCTL_URL": portal.url, "GPUCTL_TOKEN": portal.token["alice"],
           "GPUCTL_CONFIG": str(tmp_path / "none.json")}
    proc = subprocess.run(
        [sys.executable, "-m", "portal.cli", "submit", "-p", "vision", "--name", "crash", "--image", IMAGE,
         "--watch", "--interval", "0.1", "--timeout", "60", "-o", "json", "--", "false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    driver.join(30)
    assert proc.returncode == 1, proc.stderr
    final = json.loads(proc.stdout)  # progress went to stderr: stdout is one document
    assert final["state"] == "failed" and final["exit_code"] == 3
    assert "failed" in proc.stderr and "exit code 3" in proc.stderr


def test_nodes_and_gpus_per_node_make_a_multi_node_job(portal, gpuctl):
    node_add(actor=Actor(user=portal.users["admin"]), name="gpu-02", gpus="8xH100-80GB")
    result = gpuctl("submit", "-p", "vision", "--image", IMAGE, "--nodes", "2", "--gpus-per-node", "4",
                    "--", "torchrun", "train.py")
    assert result.exit_code == 0, result.stderr
    job = Job.objects.get()
    assert (job.nodes, job.gpus) == (2, 8)
    shown = gpuctl("show", job.pk)
    assert "8 GPU on 2 nodes (4 each)" in shown.stdout
    # More nodes than the cluster has: the API's field message, nothing stored.
    result = gpuctl("submit", "-p", "vision", "--image", IMAGE, "--nodes", "3", "--gpus-per-node", "4", "--", "true")
    assert result.exit_code == 2
    assert "resources.nodes: 3 exceeds the 2 node(s) with GPUs in the cluster." in result.stderr
    assert Job.objects.count() == 1
