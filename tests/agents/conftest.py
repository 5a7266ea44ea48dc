import contextlib
import os
import threading
import uuid

import pytest

JOB_IMAGE = "gpuportal/busybox:latest"


@contextlib.contextmanager
def running_agent(name, client, driver, *, lease_s):
    """A real agent (its client, a driver, one simulated GPU) registered and running its heartbeat
    and supervisor threads with a short lease; afterwards the threads end and its sandboxes go."""
    from agents.probe.sim import SimProbe
    from agents.worker import Agent

    agent = Agent(name=name, client=client, driver=driver, probe=SimProbe("1xH100-80GB", node_name=name),
                  stop_grace_s=1.0, scrub_gpus=False)
    agent.register()
    agent.heartbeat_interval_s, agent.lease_s, agent.fence_grace_s = 0.3, lease_s, 0.5
    stop = threading.Event()
    threads = [threading.Thread(target=agent.run_heartbeats, args=(stop,), daemon=True),
               threading.Thread(target=agent.run_supervisor, args=(stop, 0.1), daemon=True)]
    for th in threads:
        th.start()
    try:
        yield agent
    finally:
        stop.set()
        for th in threads:
            th.join(10)
        for _, _, handle in driver.list_own():
            driver.stop(handle, 0)
            driver.remove(handle)
        agent.join_stops()


@pytest.fixture(scope="session")
def docker_client():
    """The real engine. Without one these tests FAIL: they are how CI knows the
    sandbox works, so a missing engine must not look like a pass."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # DockerException, requests errors
        pytest.fail(f"the Docker engine is not running or not reachable ({exc}); "
                    f"start it with .ci/docker.sh", pytrace=False)
    try:
        client.images.get(JOB_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"job image {JOB_IMAGE} is missing; build it with .ci/docker.sh", pytrace=False)
    return client


@pytest.fixture
def node_name():
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def docker_driver(docker_client, node_name):
    from agents.sandbox.docker_driver import DockerDriver

    d = DockerDriver(node=node_name, client=docker_client)
    yield d
    for c in docker_client.containers.list(all=True, filters={"label": [f"gpuportal.node={node_name}"]}):
        c.remove(force=True)


def wait_done(driver, handle, timeout=60.0):
    """Poll a sandbox driver until the sandbox ends: its (state, exit code)."""
    from agents.sandbox import RUNNING
    from tests.procs import wait_for

    def ended():
        state, code = driver.poll(handle)
        return None if state == RUNNING else (state, code)

    return wait_for(ended, timeout, f"sandbox {handle.ref} to end", interval=0.02)


def make_spec(**kw):
    from agents.sandbox import LaunchSpec

    base = dict(job_id=f"job-{uuid.uuid4().hex[:8]}", attempt=1, image=JOB_IMAGE,
                command=["sh", "-c", "echo hello"], cpus=0.5, memory_mb=64, time_limit_s=60)
    base.update(kw)
    return LaunchSpec(**base)
