"""The scheduling policy settings reach the core, and bad values stop the portal at start."""
import os
import subprocess
import sys

from django.conf import settings

from scheduler import adapter


def _check(**env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    return subprocess.run([sys.executable, "manage.py", "check"], capture_output=True, text=True,
                          cwd=settings.BASE_DIR, env={**base, "DEBUG": "1", **env})


def test_policy_and_quotas_switch_reach_the_core(settings):
    settings.SCHEDULER_POLICY = "fifo-backfill"
    settings.SCHEDULER_QUOTAS = False
    cfg = adapter.config_from_settings()
    assert (cfg.policy, cfg.quotas) == ("fifo-backfill", False)


def test_every_policy_is_accepted_and_a_bad_one_is_refused_by_name():
    for policy in ("fifo", "fifo-backfill", "multifactor", "las"):
        r = _check(SCHEDULER_POLICY=policy)
        assert r.returncode == 0, r.stderr
    r = _check(SCHEDULER_POLICY="sjf")
    assert r.returncode != 0 and "SCHEDULER_POLICY" in r.stderr and "fifo-backfill" in r.stderr
    r = _check(SCHEDULER_QUOTAS="maybe")
    assert r.returncode != 0 and "SCHEDULER_QUOTAS" in r.stderr
