"""The node timers are chosen together and checked when the settings load: a value that could let
the portal start a job elsewhere before its node's agent has stopped it refuses to start."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_settings(**env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "NODE_"))}
    return subprocess.run([sys.executable, "-c", "import portal.settings as s; print(s.NODE_TIMEOUT_S + "
                           "s.NODE_REAP_INTERVAL_S)"], cwd=ROOT, env={**base, "DEBUG": "1", **env},
                          capture_output=True, text=True, timeout=60)


def test_defaults_requeue_a_dead_nodes_jobs_within_30_seconds(settings):
    r = load_settings()
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) <= 30  # node timeout + reaper period: the worst case after the last heartbeat
    fence_done = settings.AGENT_LEASE_S + settings.AGENT_FENCE_GRACE_S
    assert settings.NODE_TIMEOUT_S > fence_done  # the old attempt is dead before a new one can start
    assert settings.AGENT_LEASE_S >= 2 * settings.NODE_HEARTBEAT_INTERVAL_S


@pytest.mark.parametrize("env,message", [
    ({"AGENT_LEASE_S": "30"}, "NODE_TIMEOUT_S: 20 must be at least AGENT_LEASE_S + AGENT_FENCE_GRACE_S + 2s = 35"),
    ({"AGENT_FENCE_GRACE_S": "10"}, "NODE_TIMEOUT_S: 20 must be at least"),
    ({"AGENT_LEASE_S": "6"}, "AGENT_LEASE_S: 6 is less than two heartbeats"),
    ({"NODE_REAP_INTERVAL_S": "0"}, "NODE_REAP_INTERVAL_S: must be a positive number of seconds"),
    ({"LAUNCH_LOST_S": "60"}, "LAUNCH_LOST_S: 60 must be longer than LAUNCH_RESEND_S"),
])
def test_timers_that_could_run_a_job_twice_refuse_to_start(env, message):
    r = load_settings(**env)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-500:]
