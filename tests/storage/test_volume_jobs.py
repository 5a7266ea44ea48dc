"""Jobs with volumes on the real Docker engine: a job writes to its project's volume and the file
downloads through the API; read-only mounts refuse writes; another tenant cannot name the volume;
a checkpoint written by one attempt is there for the next, on another node."""
import os
import time
import uuid

import pytest
from django.conf import settings

from agents.sandbox import EXITED, RUNNING, LaunchSpec
from agents.sandbox.docker_driver import DockerDriver
from portal.jobs.models import Job
from portal.jobs.selectors import volume_mounts
from portal.storage.models import Volume
from tests.agents.conftest import JOB_IMAGE, docker_client  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.fixture
def drivers(docker_client):  # noqa: F811
    """Docker drivers of named nodes sharing the volumes root; their containers go at the end."""
    made = {}

    def make(node="a"):
        name = f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}-{node}"
        made[name] = DockerDriver(node=name, client=docker_client, volumes_root=str(settings.VOLUMES_ROOT))
        return made[name]

    yield make
    for name in made:
        for c in docker_client.containers.list(all=True, filters={"label": [f"gpuportal.node={name}"]}):
            c.remove(force=True)


def _submit(client, project, command, volumes, **extra):
    return client.post("/api/v1/jobs/", {"project": project, "name": "v", "image": JOB_IMAGE,
                                         "command": command, "volumes": volumes, **extra}, format="json")


def _run(driver, job: Job) -> tuple[int, bytes]:
    """Launch the job's current attempt as the agent would (its spec's volume part from the portal)."""
    spec = LaunchSpec.from_dict({"image": job.image, "command": job.command, "cpus": 0.5, "memory_mb": 64,
                                 "time_limit_s": 60, "project_id": job.project_id, **volume_mounts(job)},
                                job_id=str(job.pk), attempt=job.attempt)
    handle = driver.launch(spec)
    deadline = time.monotonic() + 60
    while (state := driver.poll(handle))[0] == RUNNING:
        assert time.monotonic() < deadline, "the job is still running"
        time.sleep(0.05)
    assert state[0] == EXITED
    return state[1], driver.read_logs(handle, 0)


def test_a_job_writes_to_its_volume_and_the_file_downloads(api, demo, drivers):
    alice = api("alice")
    volume = alice.post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json").json()
    response = _submit(alice, "vision", ["sh", "-c", "id -u; echo result > /data/x/out.txt"], [{"name": "x"}])
    assert response.status_code == 201, response.json()
    job = Job.objects.get(pk=response.json()["id"])
    assert job.volumes == response.json()["volumes"] == [{"name": "x", "read_only": False}]
    code, log = _run(drivers(), job)
    assert code == 0, log
    assert log.split()[0] == str(2000000 + demo.vision.pk).encode()
    host = settings.VOLUMES_ROOT / "acme" / "vision" / "x" / "out.txt"
    assert os.stat(host).st_uid == 2000000 + demo.vision.pk
    download = api("dave").get(f"/api/v1/volumes/{volume['id']}/download/?path=out.txt")
    assert download.status_code == 200 and b"".join(download.streaming_content) == b"result\n"
    assert api("charlie").get(f"/api/v1/volumes/{volume['id']}/download/?path=out.txt").status_code == 404


def test_a_read_only_mount_refuses_writes(api, demo, drivers):
    alice = api("alice")
    alice.post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json")
    (settings.VOLUMES_ROOT / "acme/vision/x/in.txt").write_text("input\n")
    response = _submit(alice, "vision", ["sh", "-c", "cat /data/x/in.txt; echo no > /data/x/new.txt"],
                       [{"name": "x", "read_only": True}])
    job = Job.objects.get(pk=response.json()["id"])
    code, log = _run(drivers(), job)
    assert code != 0 and b"input\n" in log and b"Read-only file system" in log, log
    assert not (settings.VOLUMES_ROOT / "acme/vision/x/new.txt").exists()


def test_another_tenant_cannot_name_the_volume(api, demo):
    api("alice").post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json")
    response = _submit(api("charlie"), "nlp", ["true"], [{"name": "x"}])
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {"volumes.0.name": ["Project nlp has no volume named 'x'."]}
    # Naming vision itself is naming a project that does not exist for charlie.
    response = _submit(api("charlie"), "vision", ["true"], [{"name": "x"}])
    assert response.status_code in (400, 404) and "project" in response.json()["error"]["fields"]
    assert not Job.objects.filter(volumes__contains=[{"name": "x"}]).exists()


@pytest.mark.parametrize("volumes,field", [
    ([{"name": "x"}, {"name": "x"}], "volumes.1.name"),
    ([{"name": "x", "mode": "rw"}], "volumes.0.mode"),
    ([{"name": "../x"}], "volumes.0.name"),
    ("x", "volumes"),
])
def test_bad_volume_lists_are_400_naming_the_field(api, demo, volumes, field):
    api("alice").post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json")
    response = _submit(api("alice"), "vision", ["true"], volumes)
    assert response.status_code == 400 and field in response.json()["error"]["fields"], response.json()


def test_a_kvm_job_names_its_projects_volumes_as_a_docker_job_does(api, demo):
    """The kvm sandbox mounts volumes (tests/agents/test_kvm_boot.py boots one): the submit is checked
    as for docker, an unknown volume still a 400 on its field."""
    api("alice").post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json")
    response = _submit(api("alice"), "vision", ["true"], [{"name": "x", "read_only": True}], sandbox="kvm")
    assert response.status_code == 201, response.json()
    assert Job.objects.get(pk=response.json()["id"]).volumes == [{"name": "x", "read_only": True}]
    response = _submit(api("alice"), "vision", ["true"], [{"name": "nope"}], sandbox="kvm")
    assert response.status_code == 400 and "volumes.0.name" in response.json()["error"]["fields"], response.json()


@pytest.mark.parametrize("volumes", [[{"name": "x"}], []], ids=["on-the-volume", "project-default"])
def test_the_next_attempt_on_another_node_sees_the_checkpoint(api, demo, drivers, volumes):
    from portal.jobs.node_effects import job_requeue_after_node_fault

    api("alice").post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json")
    script = ('echo "dir=$GPUPORTAL_CHECKPOINT_DIR"; if [ -f "$GPUPORTAL_CHECKPOINT_DIR/step" ]; '
              'then echo "resumed from $(cat $GPUPORTAL_CHECKPOINT_DIR/step)"; '
              'else echo 41 > "$GPUPORTAL_CHECKPOINT_DIR/step"; fi')
    job = Job.objects.get(pk=_submit(api("alice"), "vision", ["sh", "-c", script], volumes).json()["id"])
    code, first = _run(drivers("a"), job)
    assert code == 0 and b"resumed" not in first, first
    expected = f"/data/x/.checkpoints/{job.pk}" if volumes else "/checkpoint"
    assert f"dir={expected}\n".encode() in first
    # Preempted (its node lost): the job goes back to the queue as attempt 2 and lands elsewhere.
    Job.objects.filter(pk=job.pk).update(state="running")
    job.refresh_from_db()
    assert job_requeue_after_node_fault(job, "Node lost.") == "requeued"
    job.refresh_from_db()
    assert job.attempt == 2
    code, second = _run(drivers("b"), job)
    assert code == 0 and b"resumed from 41" in second, second
    folder = settings.VOLUMES_ROOT / "acme/vision" / ("x" if volumes else "") / ".checkpoints" / str(job.pk)
    assert (folder / "step").read_text() == "41\n"
    assert os.stat(folder).st_uid == 2000000 + demo.vision.pk and os.stat(folder).st_mode & 0o777 == 0o770


def test_the_launch_sent_to_the_node_carries_the_volumes_and_checkpoint(demo, sent, django_capture_on_commit_callbacks):
    """What the scheduler puts on the node's queue is what the agent builds its LaunchSpec from."""
    from portal.core.context import Actor
    from portal.jobs.services import job_submit
    from portal.nodes.services import node_add
    from portal.storage.services import volume_create
    from scheduler.adapter import run_pass

    alice = Actor(user=demo.users["alice"])
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    volume_create(actor=alice, project=demo.vision, name="ref")
    volume_create(actor=alice, project=demo.vision, name="out")
    job, _ = job_submit(actor=alice, data={"project": "vision", "image": JOB_IMAGE, "command": ["true"],
                                           "volumes": [{"name": "ref", "read_only": True}, {"name": "out"}]})
    with django_capture_on_commit_callbacks(execute=True):
        run_pass()
    (task, node, args), = sent
    assert task == "agent.launch" and args[:2] == [str(job.pk), 1]
    assert args[2]["volumes"] == [{"name": "ref", "read_only": True, "path": "acme/vision/ref"},
                                  {"name": "out", "read_only": False, "path": "acme/vision/out"}]
    assert args[2]["checkpoint"] == {"volume": "out", "path": f"acme/vision/out/.checkpoints/{job.pk}"}
    spec = LaunchSpec.from_dict(args[2], job_id=args[0], attempt=args[1])
    assert spec.volumes == args[2]["volumes"] and spec.project_id == demo.vision.pk


def test_a_volume_named_by_an_unfinished_job_is_not_deleted(api, demo):
    from portal.jobs.models import JobState
    from portal.jobs.states import transition

    alice = api("alice")
    volume = alice.post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json").json()
    job = _submit(alice, "vision", ["true"], [{"name": "x"}]).json()
    response = alice.delete(f"/api/v1/volumes/{volume['id']}/")
    assert response.status_code == 409 and response.json()["error"]["code"] == "volume_in_use"
    assert str(job["id"]) in response.json()["error"]["message"]
    assert (settings.VOLUMES_ROOT / "acme/vision/x").is_dir()
    assert transition(job["id"], to=JobState.CANCELLED, from_states={JobState.QUEUED})
    assert alice.delete(f"/api/v1/volumes/{volume['id']}/").status_code == 204


def test_the_process_sandbox_names_the_host_folders(demo, tmp_path, monkeypatch):
    """No mounts there: the job is told where its volume and checkpoint folder are."""
    from agents.sandbox.process_driver import ProcessDriver
    from portal.core.context import Actor
    from portal.jobs.services import job_submit
    from portal.storage.services import volume_create

    monkeypatch.setenv("GPUPORTAL_VOLUMES_ROOT", str(settings.VOLUMES_ROOT))
    volume_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="my-data")
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "image": JOB_IMAGE, "volumes": [{"name": "my-data"}],
        "command": ["sh", "-c", 'echo "$GPUPORTAL_VOLUME_MY_DATA|$GPUPORTAL_CHECKPOINT_DIR"']})
    code, log = _run(ProcessDriver(node="p", state_dir=str(tmp_path / "state")), job)
    root = os.path.realpath(settings.VOLUMES_ROOT)
    assert code == 0 and log.decode().strip() == f"{root}/acme/vision/my-data|{root}/acme/vision/my-data/.checkpoints/{job.pk}"


def test_another_projects_uid_cannot_read_the_folder_even_on_a_shared_mount(api, demo, docker_client):  # noqa: F811
    """Defence beyond the mounts: were a project's tree visible to another tenant's job (an operator's
    mistake, a shared filesystem mounted whole), that job's uid still cannot read it: 0770, owned by
    the project's uid and gid."""
    api("alice").post("/api/v1/volumes/", {"project": "vision", "name": "x"}, format="json")
    volume_id = Volume.objects.get(name="x").pk
    api("alice").put(f"/api/v1/volumes/{volume_id}/files/?path=secret.txt", data=b"vision only",
                     content_type="application/octet-stream")
    tree = str(settings.VOLUMES_ROOT / "acme" / "vision")

    def read_as(project):
        uid = 2000000 + project.pk
        # Logs are read once the container has ended: run()'s follow stream can miss a fast container's output.
        container = docker_client.containers.run(
            JOB_IMAGE, ["sh", "-c", "cat /v/x/secret.txt 2>&1; true"], user=f"{uid}:{uid}", network_mode="none",
            volumes={tree: {"bind": "/v", "mode": "ro"}}, detach=True)
        try:
            assert container.wait(timeout=60)["StatusCode"] == 0
            return container.logs(stdout=True, stderr=True)
        finally:
            container.remove(force=True)

    assert read_as(demo.vision) == b"vision only"
    assert b"Permission denied" in read_as(demo.nlp)
