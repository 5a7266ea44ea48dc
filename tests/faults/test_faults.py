"""The fault suite's short version (docs/reliability.md, section 5): one cluster of its own, a
few faults one at a time under a small load, the invariant checker after each. The full one,
every fault with more jobs and a table: `python -m tests.faults --full`.

A fault that still breaks an invariant is xfail(strict=True) with the reason (faults.KNOWN):
it shows in every run and turns into a failure the day it is fixed, so the mark goes too.
"""
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.faults.cluster import Cluster
from tests.faults.faults import KNOWN, run_case, table

# Five faults in make test; the others run in the full suite (python -m tests.faults).
# A node cut off (the agent alive, fencing itself; the node reaped; late reports refused), an agent
# dead past its lease and back within the node timeout (the supervisors fence; the returning agent's
# fenced ends requeued as node faults), the portal's own database restarted, and every portal process
# (gunicorn, the worker, beat) killed and started again, for longer than the agents' lease, and gunicorn
# frozen past the lease and the node timeout (slow, not gone: the agents keep their jobs, the reaper no node).
SHORT = ["node-partitioned", "agent-restarted-after-8s", "postgres-restarted", "portal-restarted", "portal-frozen"]


@pytest.fixture(scope="module")
def cluster():
    tmp = Path(tempfile.mkdtemp(prefix="gpuportal-faults-"))
    c = Cluster(tmp)
    try:
        c.start_all()
        yield c
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("fault", [
    pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=KNOWN[f])) if f in KNOWN else f for f in SHORT])
def test_invariants_hold_after(cluster, fault):
    # A job every 2 s during the fault, not every second: still several accepted while it lasts (each
    # must end), and a backlog that drains in seconds once it is over.
    outcome = run_case(cluster, fault, jobs=6, drain_timeout=90, submit_every_s=2.0)
    print(f"\n{table([outcome])}")
    assert not outcome.problems, "\n".join(outcome.problems)
