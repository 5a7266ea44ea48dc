"""The agent's part in pulling a job's image, with a fake portal and driver: the login is asked only
through the driver's pull, progress goes up as the job's reason, and a stale attempt, a portal
without the endpoint, a failed pull or a stop during the pull each end the launch as they should.
The real pull against a real registry: tests/agents/test_image_pull.py."""
import pytest

from agents.client import PortalError, StaleAttempt
from agents.probe.sim import SimProbe
from agents.sandbox import SandboxError
from agents.worker import Agent
from tests.agents.fakes import Clock, FakeDriver, FakePortal

SPEC = {"image": "127.0.0.1:5000/team/x:1", "command": ["true"], "cpus": 1, "memory_mb": 64, "time_limit_s": 60,
        "project_id": 3}
LOGIN = {"registry": "127.0.0.1:5000", "username": "ci", "password": "s3cret"}


class Portal(FakePortal):
    def __init__(self, clock):
        super().__init__(clock)
        self.auth_asked, self.progress_sent = [], []
        self.auth_answer = LOGIN
        self.progress_stale = False

    def registry_auth(self, job_id, attempt):
        self._call((job_id, attempt))
        self.auth_asked.append((job_id, attempt))
        if isinstance(self.auth_answer, Exception):
            raise self.auth_answer
        return dict(self.auth_answer)

    def progress(self, job_id, attempt, stage, message):
        self._call((job_id, attempt))
        if self.progress_stale:
            raise StaleAttempt("stale (fake)", 409)
        self.progress_sent.append((job_id, attempt, stage, message))
        return {"result": "applied"}


class Driver(FakeDriver):
    def __init__(self):
        super().__init__()
        self.pull = None  # what prepare_image does: fn(spec, credentials, progress, stopped)

    def prepare_image(self, spec, *, credentials, progress=None, stopped=None):
        return self.pull(spec, credentials, progress, stopped)


@pytest.fixture
def env():
    clock = Clock()
    portal, driver = Portal(clock), Driver()
    agent = Agent(name="n1", client=portal, driver=driver, probe=SimProbe("1xH100-80GB", node_name="n1"),
                  stop_grace_s=0.0, background=False, clock=clock)
    agent.register()
    return type("Env", (), dict(portal=portal, driver=driver, agent=agent))


def pulls(seen):
    def pull(spec, credentials, progress, stopped):
        seen.append(credentials())
        progress(f"pulling image {spec.image}: 50%")
        progress(f"pulling image {spec.image}: 100%")
        return "pulled"
    return pull


def test_the_image_is_pulled_with_the_login_before_the_job_starts_and_progress_is_its_reason(env):
    seen = []
    env.driver.pull = pulls(seen)
    assert env.agent.launch("j1", 1, SPEC) == "started"
    assert seen == [LOGIN] and env.portal.auth_asked == [("j1", 1)]
    assert [m for *_, m in env.portal.progress_sent] == ["pulling image 127.0.0.1:5000/team/x:1: 50%",
                                                         "pulling image 127.0.0.1:5000/team/x:1: 100%"]
    assert {s for _, _, s, _ in env.portal.progress_sent} == {"pulling"}
    assert [e[2] for e in env.portal.events] == ["starting", "running"]
    launched = env.driver.by_job("j1")
    assert "s3cret" not in str(launched)  # the sandbox never sees the login


def test_an_image_already_here_asks_for_no_login(env):
    env.driver.pull = lambda spec, credentials, progress, stopped: "present"
    assert env.agent.launch("j1", 1, SPEC) == "started"
    assert env.portal.auth_asked == [] and env.portal.progress_sent == []


def test_a_failed_pull_fails_the_job_with_its_reason(env):
    def pull(spec, credentials, progress, stopped):
        credentials()
        raise SandboxError("image x: the registry 127.0.0.1:5000 refused the project's login")
    env.driver.pull = pull
    assert env.agent.launch("j1", 1, SPEC) == "failed"
    assert env.portal.events[-1][2:] == ("failed", None, "image x: the registry 127.0.0.1:5000 refused the "
                                                         "project's login")
    assert env.driver.running() == []


def test_a_portal_without_the_endpoint_fails_the_launch_saying_so(env):
    env.portal.auth_answer = PortalError("POST /jobs/j1/registry-auth: HTTP 404: Not found", 404)
    env.driver.pull = pulls([])
    assert env.agent.launch("j1", 1, SPEC) == "failed"
    assert "the portal gave no registry login for it" in env.portal.events[-1][4]


def test_a_stale_attempt_during_the_pull_starts_nothing(env):
    env.portal.progress_stale = True
    env.driver.pull = pulls([])
    assert env.agent.launch("j1", 1, SPEC) == "stale"
    assert env.driver.running() == [] and [e[2] for e in env.portal.events] == ["starting"]


def test_a_stop_during_the_pull_cancels_the_launch(env):
    def pull(spec, credentials, progress, stopped):
        env.agent.stop("j1", 1, "cancelled by alice", wait=False)
        assert stopped()
        raise SandboxError("image x: the pull was stopped")
    env.driver.pull = pull
    assert env.agent.launch("j1", 1, SPEC) == "stale"
    assert env.portal.events[-1][2:] == ("cancelled", None, "cancelled by alice")
