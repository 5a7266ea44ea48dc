"""The agent stages a launch's datasets before its sandbox starts (a fake portal and driver, a real cache
and a real HTTP server): progress becomes the job's reason, the sandbox gets the cache's folders, a bad
dataset fails the launch saying why, references end with the report, the cached digests go up with
the heartbeat when they change, and a prefetch fills the cache ahead of a job."""
import hashlib

import pytest

from agents.datasets import DatasetCache, manifest_digest
from agents.probe.sim import SimProbe
from agents.worker import Agent
from tests.agents.fakes import Clock, FakeDriver, FakePortal

SPEC = {"image": "gpuportal/busybox:latest", "command": ["true"], "cpus": 1, "memory_mb": 256, "time_limit_s": 600}


class Portal(FakePortal):
    """FakePortal plus progress reports (the job's reason while it stages)."""

    def __init__(self, clock):
        super().__init__(clock)
        self.progress_reports = []

    def progress(self, job_id, attempt, stage, message):
        self._call((job_id, attempt))
        self.progress_reports.append((job_id, attempt, stage, message))
        return {"result": "applied"}


def entry(server, name, data: bytes) -> dict:
    url = server.put(f"{name}.bin", data)
    files = [{"path": f"{name}.bin", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    return {"name": name, "version": 1, "digest": manifest_digest(files), "size": len(data), "archive": False,
            "files": [{**files[0], "url": url}]}


@pytest.fixture
def env(tmp_path):
    clock = Clock()
    portal, driver = Portal(clock), FakeDriver()
    cache = DatasetCache(str(tmp_path / "cache"), 1024 * 1024)
    agent = Agent(name="n1", client=portal, driver=driver, probe=SimProbe("1xH100-80GB", node_name="n1"),
                  stop_grace_s=0.0, background=False, clock=clock, datasets=cache)
    agent.register()
    return type("Env", (), dict(portal=portal, driver=driver, agent=agent, cache=cache))


def test_a_launch_stages_its_datasets_and_reports_progress(env, http_files):
    ds = entry(http_files, "tiny", b"t" * 5000)
    assert env.portal.registered["cached_datasets"] == []
    assert env.agent.launch("j1", 1, {**SPEC, "datasets": [ds]}) == "started"
    (spec,) = env.driver.launched
    assert open(f"{spec.dataset_paths['tiny']}/tiny.bin", "rb").read() == b"t" * 5000
    stages = [(stage, message) for _, _, stage, message in env.portal.progress_reports]
    assert stages[0] == ("staging", "staging dataset tiny@1: 0% of 4.9 KB")
    assert stages[-1] == ("staging", "staging dataset tiny@1: 100%")
    assert env.portal.states("j1") == ["starting", "running"]
    assert env.cache.refs[ds["digest"]] == {"j1:1"}

    env.agent.heartbeat_once()
    env.agent.heartbeat_once()
    sent = [h["cached_datasets"] for h in env.portal.heartbeats if "cached_datasets" in h]
    assert sent == [[ds["digest"]]]  # once, when it changed

    env.driver.exit("j1", 0)
    env.agent.supervise_once()
    assert env.portal.states("j1")[-1] == "succeeded" and ds["digest"] not in env.cache.refs  # evictable again


def test_a_bad_dataset_fails_the_launch_with_the_reason(env, http_files):
    ds = entry(http_files, "drift", b"original")
    http_files.put("drift.bin", b"tampered")
    assert env.agent.launch("j2", 1, {**SPEC, "datasets": [ds]}) == "failed"
    assert env.driver.launched == []
    (failed,) = [e for e in env.portal.events if e[2] == "failed"]
    assert "checksum mismatch on drift.bin" in failed[4]
    assert env.cache.digests() == [] and env.cache.refs == {}


def test_a_node_without_a_cache_refuses_jobs_naming_datasets(env, http_files):
    env.agent.datasets = None
    assert env.agent.launch("j3", 1, {**SPEC, "datasets": [entry(http_files, "x", b"x")]}) == "failed"
    assert "no dataset cache" in [e for e in env.portal.events if e[2] == "failed"][0][4]


def test_prefetch_fills_the_cache_without_holding_it(env, http_files):
    ds = entry(http_files, "early", b"e" * 100)
    assert env.agent.prefetch([ds]) == "fetched"
    assert env.cache.digests() == [ds["digest"]] and env.cache.refs == {}
    assert env.agent.prefetch([ds]) == "cached" and http_files.requests["/early.bin"] == 1


def test_the_process_sandbox_names_the_cached_folder(tmp_path):
    """The process sandbox (development only) cannot mount: the job reads GPUPORTAL_DATASET_<NAME>."""
    import time

    from agents.sandbox import RUNNING
    from agents.sandbox.process_driver import ProcessDriver
    from tests.agents.conftest import make_spec

    driver = ProcessDriver(node="p", state_dir=str(tmp_path))
    spec = make_spec(command=["sh", "-c", "echo $GPUPORTAL_DATASET_TINY_SET"])
    spec.dataset_paths = {"tiny-set": "/cache/entries/abc/data"}
    handle = driver.launch(spec)
    deadline = time.monotonic() + 15
    while driver.poll(handle)[0] == RUNNING and time.monotonic() < deadline:
        time.sleep(0.02)
    assert driver.read_logs(handle, 0) == b"/cache/entries/abc/data\n"
    driver.remove(handle)


def test_a_cache_held_by_running_jobs_reports_the_launch_not_startable_here(env, http_files):
    """The 1 MB cache is held by a running job: another version that would fit an empty cache is
    reported not startable on this node (requeued elsewhere), not failed; a portal before protocol
    1.5 gets the plain failure it understands."""
    held = entry(http_files, "held", b"h" * 700 * 1024)
    assert env.agent.launch("j1", 1, {**SPEC, "datasets": [held]}) == "started"
    other = entry(http_files, "other", b"o" * 600 * 1024)
    assert env.agent.launch("j2", 1, {**SPEC, "datasets": [other]}) == "failed"
    ((job, attempt, why),) = env.portal.not_startable
    assert (job, attempt) == ("j2", 1) and why.startswith("dataset cache full on node n1: this node's dataset cache "
                                                          "is full: dataset other@1 needs 600.0 KB"), why
    assert env.cache.refs == {held["digest"]: {"j1:1"}}  # nothing of other@1 kept or held

    env.agent.says_not_startable = False
    assert env.agent.launch("j3", 1, {**SPEC, "datasets": [other]}) == "failed"
    assert len(env.portal.not_startable) == 1
    assert "dataset cache is full" in [e for e in env.portal.events if e[0] == "j3"][-1][4]
    # Larger than the whole cache: no node like this one could take it, so it fails as before.
    env.agent.says_not_startable = True
    big = entry(http_files, "big", b"b" * 2 * 1024 * 1024)
    assert env.agent.launch("j4", 1, {**SPEC, "datasets": [big]}) == "failed"
    assert len(env.portal.not_startable) == 1
