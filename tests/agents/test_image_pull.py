"""The docker sandbox's image pulls and per-node cache against a real registry (Debian's
docker-registry on loopback, htpasswd logins) and the real engine: a project's login pulls its
private image, a wrong or missing one fails with the job's reason, another project never gets the
image from the cache without its own login, :latest is pulled again, and the cache's size limit
removes the least recently used image no container uses."""
import docker.errors
import pytest

from agents.sandbox import SandboxError
from agents.sandbox.images import ImageCache, PullStopped
from tests.agents.conftest import JOB_IMAGE, make_spec
from tests.procs import wait_for
from tests.registry import LOGINS, pushed, registry  # noqa: F401 (fixtures)

LOGIN = LOGINS


def login(registry, password=None):
    calls = []

    def credentials():
        calls.append(1)
        return {"registry": registry.host, "username": "ci", "password": LOGIN["ci"] if password is None else password}

    return credentials, calls


def no_login(registry):
    calls = []
    return (lambda: calls.append(1) or {"registry": registry.host, "username": "", "password": ""}), calls


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        self.t += 10
        return self.t


def test_a_projects_login_pulls_its_private_image_and_the_job_runs_from_it(docker_driver, docker_client, registry,
                                                                           pushed, tmp_path):
    ref = pushed(registry, docker_client, command_marker="private-marker")
    docker_driver.images = cache = ImageCache(docker_client, node=docker_driver.node, state_path=tmp_path / "i.json",
                                              progress_interval_s=0)
    spec = make_spec(image=ref, project_id=7, command=["sh", "-c", "cat /etc/image-marker; env"])
    credentials, calls = login(registry)
    seen = []
    assert docker_driver.prepare_image(spec, credentials=credentials, progress=seen.append) == "pulled"
    assert calls == [1] and cache.pulls == 1
    assert seen and all(s.startswith(f"pulling image {ref}: ") and s.endswith("%") for s in seen)
    assert seen[-1] == f"pulling image {ref}: 100%"
    handle = docker_driver.launch(spec)
    wait_for(lambda: docker_driver.poll(handle)[0] != "running", 30, "the job to end")
    out = docker_driver.read_logs(handle, 0)
    assert out.startswith(b"private-marker\n"), out
    assert LOGIN["ci"].encode() not in out  # not in the job's environment
    inspected = docker_client.api.inspect_container(handle.ref)
    assert LOGIN["ci"] not in str(inspected)
    record = cache.records()[ref]
    assert record["projects"] == ["7"] and record["size"] > 0
    assert LOGIN["ci"] not in (tmp_path / "i.json").read_text()

    # Cached: the same project's next job neither pulls nor asks for the login.
    assert docker_driver.prepare_image(spec, credentials=credentials) == "present"
    assert calls == [1] and cache.pulls == 1


def test_another_project_does_not_get_the_cached_image_without_its_own_login(docker_driver, docker_client, registry,
                                                                            pushed, tmp_path):
    ref = pushed(registry, docker_client)
    docker_driver.images = cache = ImageCache(docker_client, node=docker_driver.node, state_path=tmp_path / "i.json")
    credentials, _ = login(registry)
    assert docker_driver.prepare_image(make_spec(image=ref, project_id=1), credentials=credentials) == "pulled"
    anonymous, calls = no_login(registry)
    with pytest.raises(SandboxError) as err:
        docker_driver.prepare_image(make_spec(image=ref, project_id=2), credentials=anonymous)
    assert calls == [1]
    assert f"image {ref}: the registry {registry.host} needs a login and the project has none" in str(err.value)
    assert cache.records()[ref]["projects"] == ["1"]
    # With a login of its own it gets the image (the registry said yes to it too).
    assert docker_driver.prepare_image(make_spec(image=ref, project_id=2), credentials=credentials) == "pulled"
    assert cache.records()[ref]["projects"] == ["1", "2"]


def test_a_wrong_or_missing_login_fails_with_a_clear_reason(docker_driver, docker_client, registry, pushed,
                                                            tmp_path):
    ref = pushed(registry, docker_client)
    docker_driver.images = ImageCache(docker_client, node=docker_driver.node, state_path=tmp_path / "i.json")
    wrong, _ = login(registry, password="not-it")
    with pytest.raises(SandboxError) as err:
        docker_driver.prepare_image(make_spec(image=ref, project_id=1), credentials=wrong)
    assert f"image {ref}: the registry {registry.host} refused the project's login" in str(err.value)
    assert "not-it" not in str(err.value)
    anonymous, _ = no_login(registry)
    with pytest.raises(SandboxError, match="needs a login and the project has none"):
        docker_driver.prepare_image(make_spec(image=ref, project_id=1), credentials=anonymous)
    credentials, _ = login(registry)
    with pytest.raises(SandboxError, match=f"image {registry.host}/team/nothing-here:1: not found in {registry.host}"):
        docker_driver.prepare_image(make_spec(image=f"{registry.host}/team/nothing-here:1", project_id=1),
                                    credentials=credentials)
    unusable = lambda: {"registry": registry.host, "username": "ci", "password": "", "problem": "cannot be decrypted"}
    with pytest.raises(SandboxError, match="cannot be decrypted"):
        docker_driver.prepare_image(make_spec(image=ref, project_id=1), credentials=unusable)
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.images.get(ref)  # nothing was pulled


def test_latest_is_pulled_again_and_the_operators_own_images_are_used_as_they_are(docker_driver, docker_client,
                                                                                  registry, pushed, tmp_path):
    latest = pushed(registry, docker_client, tag="latest")
    docker_driver.images = cache = ImageCache(docker_client, node=docker_driver.node, state_path=tmp_path / "i.json")
    credentials, calls = login(registry)
    for _ in range(2):
        assert docker_driver.prepare_image(make_spec(image=latest, project_id=1), credentials=credentials) == "pulled"
    assert cache.pulls == 2 and calls == [1, 1]
    # The CI's busybox image was imported by the operator: no registry has it, and it runs as it is.
    never, asked = no_login(registry)
    assert docker_driver.prepare_image(make_spec(image=JOB_IMAGE, project_id=1), credentials=never) == "present"
    assert asked == [] and cache.pulls == 2 and JOB_IMAGE not in cache.records()


def test_a_stop_during_the_pull_ends_it(docker_driver, docker_client, registry, pushed, tmp_path):
    ref = pushed(registry, docker_client)
    docker_driver.images = ImageCache(docker_client, node=docker_driver.node, state_path=tmp_path / "i.json")
    credentials, _ = login(registry)
    with pytest.raises(PullStopped, match="the pull was stopped"):
        docker_driver.prepare_image(make_spec(image=ref, project_id=1), credentials=credentials, stopped=lambda: True)


def test_the_size_limit_removes_the_least_recently_used_image_no_container_uses(docker_driver, docker_client,
                                                                                registry, pushed, tmp_path):
    refs = [pushed(registry, docker_client) for _ in range(3)]
    clock = Clock()
    docker_driver.images = cache = ImageCache(docker_client, node=docker_driver.node, state_path=tmp_path / "i.json",
                                              clock=clock)
    credentials, _ = login(registry)
    first, second, third = refs
    for ref in (first, second):
        cache.ensure(ref, project_id=1, credentials=credentials)
        cache.unpin(ref)
    # A container (a job's, not yet removed) uses the oldest one.
    user = docker_driver.launch(make_spec(image=first, project_id=1, command=["sleep", "30"]))
    size = cache.records()[first]["size"]
    cache.limit_bytes = size + size // 2  # room for one image only
    cache.ensure(third, project_id=1, credentials=credentials)  # over the limit: the LRU unused one goes
    kept = cache.records()
    assert set(kept) == {first, third}, kept
    assert docker_client.images.list(name=second.rsplit(":", 1)[0]) == []
    assert docker_client.images.get(first) and docker_client.images.get(third)
    # The image a launch just ensured (pinned) is never the one removed, even over the limit.
    cache.limit_bytes = 1
    assert cache.evict() == []  # first: used by a container; third: pinned for its launch
    docker_driver.stop(user, 0)
    docker_driver.remove(user)
    cache.unpin(third)
    assert sorted(cache.evict()) == sorted([first, third])
    assert cache.records() == {}
