"""What the agent's heartbeat says it holds: the portal reconciles its own view against it."""

import threading

from agents.probe.sim import SimProbe
from agents.worker import Agent
from tests.agents.fakes import Clock, FakeDriver, FakePortal

SPEC = {"image": "gpuportal/busybox:latest", "command": ["sh", "-c", "train"], "cpus": 2,
        "memory_mb": 1024, "time_limit_s": 600, "gpu_indexes": [1]}


class SlowDriver(FakeDriver):
    """A launch that takes its time (an image pull, a VM boot) until `go` is set."""

    def __init__(self):
        super().__init__()
        self.in_launch, self.go = threading.Event(), threading.Event()

    def launch(self, spec):
        self.in_launch.set()
        assert self.go.wait(10)
        return super().launch(spec)


def test_a_launch_in_progress_is_listed_as_starting_then_running():
    clock, wall = Clock(), Clock(1000.0)
    portal, driver = FakePortal(clock), SlowDriver()
    agent = Agent(name="n1", client=portal, driver=driver, probe=SimProbe("2xH100-80GB", node_name="n1", clock=wall),
                  stop_grace_s=0.0, background=False, clock=clock, wall=wall)
    agent.register()
    th = threading.Thread(target=agent.launch, args=("j1", 1, SPEC))
    th.start()
    try:
        assert driver.in_launch.wait(10)
        agent.heartbeat_once()
        # Not running yet, but held: the portal must neither requeue it nor call it lost.
        assert portal.heartbeats[-1]["jobs"] == [{"job_id": "j1", "attempt": 1, "state": "starting"}]
    finally:
        driver.go.set()
        th.join(10)
    agent.heartbeat_once()
    assert portal.heartbeats[-1]["jobs"] == [{"job_id": "j1", "attempt": 1, "state": "running"}]
