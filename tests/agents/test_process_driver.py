import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agents.sandbox import EXITED, RUNNING, SandboxError
from agents.sandbox.process_driver import ProcessDriver
from tests.agents.conftest import make_spec, wait_done


@pytest.fixture
def driver(tmp_path):
    d = ProcessDriver(node="p", state_dir=str(tmp_path))
    yield d
    d.close()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_one_spawner_forks_every_jobs_supervisor(driver):
    """The jobs' supervisors are forked by one spawner per node, not started as interpreters by the
    agent: each leads a session of its own (the group stop() signals), and each job's code arrives."""
    handles = [driver.launch(make_spec(command=["sh", "-c", f"exit {i}"])) for i in range(3)]
    sleeper = driver.launch(make_spec(command=["sleep", "300"]))
    pid = driver._record(sleeper.ref)["pid"]
    spawner = driver._spawner._proc.pid
    assert _parent(pid) == spawner != os.getpid() and os.getsid(pid) == pid
    assert [wait_done(driver, h) for h in handles] == [(EXITED, 0), (EXITED, 1), (EXITED, 2)]
    driver.stop(sleeper, grace_s=2)
    assert wait_done(driver, sleeper) == (EXITED, 143)
    for h in [*handles, sleeper]:
        driver.remove(h)
    assert driver._spawner._pids == set()  # a removed sandbox's pid is not kept for ever


def test_a_supervisor_killed_first_gets_its_code_from_the_spawner(driver):
    """SIGKILL to the job's group ends its supervisor before it writes the exit record: the spawner,
    its parent, writes the code from the wait status, as the agent's own waitpid used to say it."""
    h = driver.launch(make_spec(command=["sleep", "300"]))
    pid = driver._record(h.ref)["pid"]
    os.killpg(pid, signal.SIGKILL)
    assert wait_done(driver, h) == (EXITED, 137)
    assert (driver.state_dir / h.ref / "exit").read_text() == "137\n"


def test_jobs_outlive_their_spawner_and_a_new_one_starts_at_the_next_launch(driver, tmp_path):
    """The spawner dies (the agent's group killed, or it alone): its jobs run on in their sessions,
    each supervisor still writes its code, and the next launch starts another spawner."""
    h = driver.launch(make_spec(command=["sh", "-c", "read _ < /dev/null; sleep 300"]))
    first = driver._spawner._proc
    first.kill()
    first.wait()
    assert driver.poll(h) == (RUNNING, None)
    h2 = driver.launch(make_spec(command=["true"]))
    assert driver._spawner._proc.pid != first.pid
    assert wait_done(driver, h2) == (EXITED, 0)
    driver.stop(h, grace_s=2)
    assert wait_done(driver, h) == (EXITED, 143)


def test_the_agent_gone_ends_the_spawner_not_the_jobs(driver):
    """End of the spawner's input (the agent exited) ends the spawner; the job runs on."""
    h = driver.launch(make_spec(command=["sleep", "300"]))
    spawner = driver._spawner._proc
    driver.close()
    assert spawner.returncode == 0
    assert driver.poll(h) == (RUNNING, None)
    driver.stop(h, grace_s=2)
    assert wait_done(driver, h)[0] == EXITED


def test_runs_a_command_and_returns_output_and_exit_code(driver, caplog):
    with caplog.at_level(logging.WARNING):
        h = driver.launch(make_spec(command=["sh", "-c", "echo out; echo err >&2; echo $GPUPORTAL_JOB_ID; exit 3"],
                                    env={"LD_PRELOAD": "x"}))
    assert "NO ISOLATION" in caplog.text
    assert wait_done(driver, h) == (EXITED, 3)
    logs = driver.read_logs(h, 0)
    assert logs.startswith(b"out\nerr\n") and h.job_id.encode() in logs
    assert driver.read_logs(h, 4) == logs[4:]


def test_gpu_job_sees_host_indexes(driver):
    h = driver.launch(make_spec(gpu_indexes=[3, 5], gpu_uuids=["GPU-a", "GPU-b"],
                                command=["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]))
    wait_done(driver, h)
    assert driver.read_logs(h, 0) == b"3,5\n"


def test_stop_terms_then_kills_the_whole_group(driver):
    # The child ignores TERM too: only the group-wide SIGKILL ends it.
    h = driver.launch(make_spec(command=["sh", "-c", "trap '' TERM; sleep 300 & echo ready; wait"]))
    deadline = time.monotonic() + 5
    while b"ready" not in driver.read_logs(h, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    driver.stop(h, grace_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5
    assert wait_done(driver, h) == (EXITED, 137)


def test_sigterm_ends_a_cooperative_job_quickly(driver):
    h = driver.launch(make_spec(command=["sleep", "300"]))
    t0 = time.monotonic()
    driver.stop(h, grace_s=10)
    assert time.monotonic() - t0 < 3
    assert wait_done(driver, h) == (EXITED, 143)


def test_list_own_survives_an_agent_restart(driver, tmp_path):
    h = driver.launch(make_spec(job_id="j9", attempt=2, command=["sh", "-c", "echo ready; exec sleep 300"]))
    deadline = time.monotonic() + 5
    while b"ready" not in driver.read_logs(h, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    again = ProcessDriver(node="p", state_dir=str(tmp_path))
    ((job, attempt, h2),) = again.list_own()
    assert (job, attempt, h2.ref) == ("j9", 2, h.ref)
    assert again.poll(h2) == (RUNNING, None)
    again.stop(h2, grace_s=2)
    driver.poll(h)  # reap our child so it is not left a zombie
    assert again.poll(h2) == (EXITED, 143)  # not our child: the wrapper recorded its code
    again.remove(h2)
    assert again.list_own() == []


def test_duplicate_and_bad_command(driver):
    spec = make_spec(command=["sleep", "5"])
    h = driver.launch(spec)
    with pytest.raises(SandboxError):
        driver.launch(spec)
    driver.remove(h)
    with pytest.raises(SandboxError, match="no-such-binary"):
        driver.launch(make_spec(command=["no-such-binary"]))


def test_a_launch_an_agent_died_in_is_finished_once(driver, tmp_path):
    """An agent killed inside launch(), between the sandbox folder and its record: the next launch
    of that attempt starts it when nothing had started, and adopts the process that had, so the job
    neither fails on "already exists" nor runs twice."""
    spec = make_spec(job_id="j7", attempt=1, command=["true"])
    (driver.state_dir / "gpuportal-j7-1" / "work").mkdir(parents=True)  # folder made, nothing started
    h = driver.launch(spec)
    assert wait_done(driver, h) == (EXITED, 0)
    driver.remove(h)

    spec = make_spec(job_id="j8", attempt=1, command=["true"])
    work = driver.state_dir / "gpuportal-j8-1" / "work"
    work.mkdir(parents=True)  # the wrapper had started when the agent died: its process runs on
    orphan = subprocess.Popen(["sleep", "300"], cwd=work, start_new_session=True)
    try:
        with pytest.raises(SandboxError, match="already exists"):
            driver.launch(spec)
        ((job, attempt, adopted),) = ProcessDriver(node="p", state_dir=str(tmp_path)).list_own()
        assert (job, attempt) == ("j8", 1) and driver.poll(adopted) == (RUNNING, None)
        assert driver._record(adopted.ref)["pid"] == orphan.pid
        assert orphan.poll() is None  # adopted, not started a second time nor killed
    finally:
        orphan.kill()
        orphan.wait()
