"""Private images end to end: the portal (live server), the scheduler worker, a real agent process with
the docker sandbox, and a real registry on loopback with htpasswd logins (Debian's docker-registry).
A project with the right login runs a job from its private image; another project's job with the same
image (by then in the node's cache) fails, as do a wrong login and a missing one, each saying why; the
secret is in no job's log or environment and in no log of the agent or the scheduler worker."""
import docker
import pytest
from rest_framework.test import APIClient

from tests.conftest import make_token
from tests.e2e_agent.test_stack import stack  # noqa: F401 (the fixture)
from tests.procs import wait_for
from tests.registry import LOGINS, pushed, registry  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)
WRONG = "not-the-password"


@pytest.fixture(autouse=True)
def allowed(demo, registry):  # noqa: F811
    for project in (demo.vision, demo.nlp):
        project.quota.allowed_images = [*project.quota.allowed_images, f"{registry.host}/team/*"]
        project.quota.save()


def finished(stack, job_id):
    return stack.wait_state(job_id, {"succeeded", "failed", "cancelled"}, timeout=120)


def test_a_projects_login_pulls_its_private_image_and_nobody_elses_job_gets_it(stack, api, demo, registry,  # noqa: F811
                                                                              pushed):  # noqa: F811
    engine = docker.from_env()
    ref = pushed(registry, engine, command_marker="from-the-private-registry")
    other = pushed(registry, engine)
    (user, password), = LOGINS.items()
    alice = api("alice")
    r = alice.post("/api/v1/registry-credentials/", {"project": "vision", "registry": registry.host,
                                                    "username": user, "secret": password}, format="json")
    assert r.status_code == 201, r.content

    job_id = stack.submit(image=ref, command=["sh", "-c", "cat /etc/image-marker; env"])
    job = finished(stack, job_id)
    assert job["state"] == "succeeded", (job, stack.log("agent")[-3000:])
    logs = wait_for(lambda: (r := stack.client.get(f"/api/v1/jobs/{job_id}/logs/").json())["data"] and r, 30,
                    "the job's log")["data"]
    assert logs.startswith("from-the-private-registry\n") and "PATH=" in logs, logs
    assert password not in logs

    # Charlie's project has no login: the image on the node is not his to use.
    charlie = APIClient()
    charlie.credentials(HTTP_AUTHORIZATION=f"Bearer {make_token(demo.users['charlie'], ['read', 'submit'])}")
    r = charlie.post("/api/v1/jobs/", {"project": "nlp", "image": ref, "command": ["cat", "/etc/image-marker"],
                                       "resources": {"gpus": 0, "cpus": 0.5, "memory_mb": 128}}, format="json")
    assert r.status_code == 201, r.content
    job = wait_for(lambda: (j := charlie.get(f"/api/v1/jobs/{r.json()['id']}/").json())["state"] in ("failed",
                                                                                                    "succeeded") and j,
                   120, "nlp's job to end")
    assert job["state"] == "failed", job
    assert f"the registry {registry.host} needs a login and the project has none" in job["reason"]["message"], job

    # A wrong login: the registry refuses it, and the job says so.
    r = alice.post("/api/v1/registry-credentials/", {"project": "vision", "registry": registry.host,
                                                    "username": user, "secret": WRONG}, format="json")
    assert r.status_code == 201
    job = finished(stack, stack.submit(image=other, command=["true"]))
    assert job["state"] == "failed", job
    assert f"the registry {registry.host} refused the project's login" in job["reason"]["message"], job

    # No login at all.
    alice.delete(f"/api/v1/registry-credentials/{r.json()['id']}/")
    job = finished(stack, stack.submit(image=other, command=["true"]))
    assert job["state"] == "failed" and "needs a login and the project has none" in job["reason"]["message"], job

    for process in ("agent", "worker"):
        text = stack.log(process)
        assert password not in text and WRONG not in text, process
    assert "pulling image" in stack.log("agent") and "could not report the pull's progress" not in stack.log("agent")
