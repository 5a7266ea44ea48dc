"""A real image registry for the tests: Debian's ``docker-registry`` (the CNCF distribution registry),
installed by .ci/services.sh, on a free loopback port with htpasswd (bcrypt) logins and no TLS:
dockerd takes plain HTTP from 127.0.0.0/8 (its default insecure range). ``push_image`` puts a
small image there from the local busybox job image, under a fresh name so no node has it yet."""
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.procs import start_process, stop_process, wait_for
from tests.s3 import free_ports

BASE_IMAGE = "gpuportal/busybox:latest"
CONFIG = """version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
auth:
  htpasswd:
    realm: gpuportal-test
    path: {htpasswd}
"""


@dataclass
class Registry:
    host: str  # 127.0.0.1:<port>, as image references start
    proc: subprocess.Popen
    log_path: Path
    logins: dict  # username -> password

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def push_image(self, docker_client, *, name: str = "", tag: str = "1", command_marker: str = "") -> str:
        """Tag the local busybox image as <host>/<name>:<tag> (plus a file, so each push is its own
        image), push it with the first login, remove the local tag: -> the reference."""
        user, password = next(iter(self.logins.items()))
        repo = f"{self.host}/team/{name or 'img-' + uuid.uuid4().hex[:8]}"
        marker = command_marker or uuid.uuid4().hex
        # A one-layer image of its own: the busybox image plus a file naming it, built without a
        # Dockerfile (a container's commit), so no registry is needed to build it.
        c = docker_client.containers.create(BASE_IMAGE, ["sh", "-c", "true"], network_mode="none")
        try:
            import io
            import tarfile

            data = io.BytesIO()
            with tarfile.open(fileobj=data, mode="w") as tar:
                info = tarfile.TarInfo("etc/image-marker")
                body = (marker + "\n").encode()
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
            c.put_archive("/", data.getvalue())
            c.commit(repository=repo, tag=tag, conf={"User": "65534:65534", "WorkingDir": "/work", "Cmd": ["sh"]})
        finally:
            c.remove(force=True)
        ref = f"{repo}:{tag}"
        for line in docker_client.api.push(repo, tag=tag, stream=True, decode=True,
                                           auth_config={"username": user, "password": password}):
            assert "error" not in line, (line, self.log())
        docker_client.images.remove(ref)
        return ref


def start_registry(folder: Path, logins: dict) -> Registry:
    binary = shutil.which("docker-registry")
    assert binary, "docker-registry is missing: run .ci/services.sh (Debian's docker-registry package)"
    htpasswd_bin = shutil.which("htpasswd")
    assert htpasswd_bin, "htpasswd is missing: run .ci/services.sh (Debian's apache2-utils package)"
    folder.mkdir(parents=True, exist_ok=True)
    htpasswd = folder / "htpasswd"
    htpasswd.write_text("")
    for user, password in logins.items():
        subprocess.run([htpasswd_bin, "-Bb", str(htpasswd), user, password], check=True, capture_output=True)
    (port,) = free_ports(1)
    config = folder / "config.yml"
    config.write_text(CONFIG.format(root=folder / "data", port=port, htpasswd=htpasswd))
    log_path = folder / "registry.log"
    with open(log_path, "wb") as log:
        proc = start_process([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    registry = Registry(f"127.0.0.1:{port}", proc, log_path, dict(logins))

    def answers():
        if proc.poll() is not None:
            return True
        try:
            return requests.get(f"http://{registry.host}/v2/", timeout=1).status_code == 401
        except requests.RequestException:
            return False

    try:
        wait_for(answers, 30, "the registry to answer")
        assert proc.poll() is None, f"docker-registry exited:\n{registry.log()}"
    except BaseException:
        stop_process(proc)
        raise
    return registry


def stop_registry(registry: Registry) -> None:
    stop_process(registry.proc)


LOGINS = {"ci": "s3cret-pull-token"}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A registry with the login ``LOGINS`` for the tests of one module, stopped afterwards. Import it
    into a test module to use it."""
    server = start_registry(tmp_path_factory.mktemp("registry"), LOGINS)
    try:
        yield server
    finally:
        stop_registry(server)


@pytest.fixture
def pushed():
    """-> push(docker_client, **kw): a fresh image in ``registry``; each is removed from the engine afterwards."""
    made = []

    def push(server, docker_client, **kw):
        ref = server.push_image(docker_client, **kw)
        made.append((docker_client, ref))
        return ref

    yield push
    for docker_client, ref in made:
        try:
            docker_client.images.remove(ref, force=True)
        except Exception:  # never pulled (the test's point), or already removed
            pass
