import os
import uuid

import pytest

JOB_IMAGE = "gpuportal/busybox:latest"


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


def make_spec(**kw):
    from agents.sandbox import LaunchSpec

    base = dict(job_id=f"job-{uuid.uuid4().hex[:8]}", attempt=1, image=JOB_IMAGE,
                command=["sh", "-c", "echo hello"], cpus=0.5, memory_mb=64, time_limit_s=60)
    base.update(kw)
    return LaunchSpec(**base)
