"""Checkpoint-aware stops with real sandboxes (process and docker): a job that traps SIGUSR1 saves
to GPUPORTAL_CHECKPOINT_DIR when the agent stops it to move it, and its next attempt, in a fresh
sandbox, resumes from what it saved; a job near its time limit hears the signal in time to save."""
import os
import time
import uuid

import pytest

from agents.probe.sim import SimProbe
from agents.sandbox.docker_driver import DockerDriver
from agents.sandbox.process_driver import ProcessDriver
from agents.worker import Agent
from tests.agents.conftest import JOB_IMAGE
from tests.agents.fakes import FakePortal
from tests.procs import wait_for

# Counts steps; on SIGUSR1 writes the step it reached and exits; on start resumes from a saved step.
TRAIN = r'''
ck="$GPUPORTAL_CHECKPOINT_DIR"
trap 'echo "$i" > "$ck/step.tmp" && mv "$ck/step.tmp" "$ck/step"; echo "saved at $i"; exit 0' USR1
i=0
if [ -f "$ck/step" ]; then i=$(cat "$ck/step"); echo "resumed from $i"; else echo "fresh start"; fi
while [ "$i" -lt 100000 ]; do i=$((i+1)); [ $((i % 10)) -eq 0 ] && echo "step $i"; sleep 0.05; done
echo finished
'''
CHECKPOINT = {"volume": None, "path": "acme/vision/.checkpoints/7"}


def spec(**extra):
    return {"image": JOB_IMAGE, "command": ["sh", "-c", TRAIN], "cpus": 0.5, "memory_mb": 64,
            "time_limit_s": 600, "checkpoint": CHECKPOINT, "checkpoint_signal": "SIGUSR1",
            "checkpoint_grace_s": 20, "project_id": 1, **extra}  # docker: the project's uid owns the folder


@pytest.fixture(params=["process", "docker"])
def env(request, tmp_path, monkeypatch):
    root = tmp_path / "volumes"
    root.mkdir()
    if request.param == "process":
        monkeypatch.setenv("GPUPORTAL_VOLUMES_ROOT", str(root))
        driver = ProcessDriver(node="ckpt", state_dir=str(tmp_path / "agent"))
    else:
        client = request.getfixturevalue("docker_client")
        node = f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        driver = DockerDriver(node=node, client=client, volumes_root=str(root))
    portal = FakePortal(time.monotonic)  # the agent's own clock: the lease file it writes is real
    agent = Agent(name="ckpt", client=portal, driver=driver, probe=SimProbe("1xH100-80GB", node_name="ckpt"),
                  stop_grace_s=1.0, scrub_gpus=False, background=False)
    agent.register()
    agent.lease_s = 3600.0  # no heartbeats here: a lease this long outlasts the test
    try:
        yield type("Env", (), dict(agent=agent, driver=driver, portal=portal, folder=root / CHECKPOINT["path"]))
    finally:
        for _, _, handle in driver.list_own():
            driver.stop(handle, 0)
            driver.remove(handle)


def log_of(env, job_id, attempt) -> str:
    t = env.agent.jobs()[(job_id, attempt)]
    return env.driver.read_logs(t.handle, 0).decode()


def test_a_moved_job_saves_on_its_signal_and_the_next_attempt_resumes(env):
    assert env.agent.launch("7", 1, spec()) == "started"
    wait_for(lambda: "step 10\n" in log_of(env, "7", 1), 30, "attempt 1 to count")
    # The portal requeued it (preemption, a move, a drain): the old attempt gets SIGUSR1 and 20 s.
    assert env.agent.stop("7", 1, "preempted", 20, signal="SIGUSR1")
    ((_, _, state, code, message),) = [e for e in env.portal.events if e[:2] == ("7", 1) and e[2] == "cancelled"]
    assert code == 0 and message == "preempted"  # it exited by itself within its grace, having saved
    saved = int((env.folder / "step").read_text())
    assert saved > 0

    assert env.agent.launch("7", 2, spec()) == "started"
    wait_for(lambda: "resumed from" in log_of(env, "7", 2), 30, "attempt 2 to start")
    assert f"resumed from {saved}\n" in log_of(env, "7", 2)
    assert env.agent.stop("7", 2, "cancelled", 0)


def test_a_job_near_its_time_limit_gets_its_signal_while_it_can_still_save(env):
    # Limit 25 s, grace 20 s: the signal goes out 5 s after the start, long before the limit.
    assert env.agent.launch("8", 1, spec(time_limit_s=25)) == "started"

    def ended():
        env.agent.supervise_once()
        return [e for e in env.portal.events if e[:2] == ("8", 1) and e[2] not in ("starting", "running")]

    (end,) = wait_for(ended, 40, "the job to end")
    # It saved and exited by itself; without the signal it would have been killed at the limit (timeout).
    assert end[2:4] == ("succeeded", 0), end
    assert int((env.folder / "step").read_text()) > 0
