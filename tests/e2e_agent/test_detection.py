"""Detection with the default timers, end to end: the real agent, the scheduler worker and beat
(the reaper every NODE_REAP_INTERVAL_S). An agent killed for good has its node marked down and
its job requeued within 30 s of its death, and not before its lease and fence grace could end."""
import sys
import time

import pytest
from django.conf import settings

from portal.nodes.models import Node
from tests.e2e_agent.test_stack import Stack, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def stack(live_server, tmp_path, demo):
    s = Stack(live_server, tmp_path, demo)
    try:
        s.start_all()
        s.start("beat", [sys.executable, "-m", "celery", "-A", "portal", "beat", "-s", str(tmp_path / "beat-schedule"),
                         "--loglevel", "INFO"])
        yield s
    finally:
        s.close()


def test_a_dead_node_is_down_and_its_job_requeued_within_30_seconds(stack):
    job_id = stack.submit(command=["sleep", "300"])
    stack.wait_state(job_id, "running")
    stack.kill_agent()
    died = time.monotonic()
    job = wait_for(lambda: (j := stack.job(job_id))["attempt"] == 2 and j, 60,
                   f"the reaper to requeue job {job_id}; worker log:\n{stack.log('worker')[-3000:]}")
    took = time.monotonic() - died
    node = Node.objects.get(name=stack.name)
    assert node.state == "down" and job["state"] in ("queued", "assigned")
    assert took <= 30, f"requeued {took:.1f}s after the agent died"
    # Never before the silence could be the agent's own fencing: the last heartbeat came at most
    # one interval before the death, and the portal waits NODE_TIMEOUT_S from it.
    assert took >= settings.NODE_TIMEOUT_S - settings.NODE_HEARTBEAT_INTERVAL_S - 1
    print(f"\ndetection: job {job_id} requeued {took:.1f}s after its agent was killed "
          f"(NODE_TIMEOUT_S {settings.NODE_TIMEOUT_S:g}, reaper every {settings.NODE_REAP_INTERVAL_S:g}s)")
