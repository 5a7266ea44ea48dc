"""From an agent's death to its jobs running elsewhere: p50 and max over N kills (a figure, not a test).

    .venv/bin/python bench/kill_bench.py              # 10 kills, the portal's default timers
    .venv/bin/python bench/kill_bench.py --fast       # the fault suite's timers (lease 6 s, timeout 10 s)

Starts the fault suite's installation of its own (tests/faults/cluster.py: a throwaway PostgreSQL
and Redis, gunicorn, a Celery worker and beat, four process-sandbox agents with four simulated GPUs
each). Each round submits four 1-GPU jobs of five minutes, waits until they run, SIGKILLs the agent
(its whole process group; the jobs' own sessions live on under their supervisors) of a node that runs
some, and stamps, for each of that node's jobs, the moment the portal's database says it runs again,
as a new attempt on another node. A round's figure is its slowest job. Then the jobs are cancelled,
the agent is started again and the next round waits until every node is ready.

With the default timers the path is: heartbeat every 5 s, the node's silence counted from its last
heartbeat's receipt, NODE_TIMEOUT_S 20 s, the reaper every 5 s, then a scheduling pass, the launch
on another node's queue, the agent's confirm, start and `running` report.
"""
import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults.checker import job_command  # noqa: E402
from tests.faults.cluster import TIMERS, Cluster  # noqa: E402
from tests.procs import wait_for  # noqa: E402

JOBS_PER_ROUND = 4
# The portal's defaults, spelled out so the figure says what it was measured with (portal/settings.py).
DEFAULT_TIMERS = {"NODE_HEARTBEAT_INTERVAL_S": "5", "AGENT_LEASE_S": "15", "AGENT_FENCE_GRACE_S": "3",
                  "NODE_TIMEOUT_S": "20", "NODE_REAP_INTERVAL_S": "5"}


def submit(c: Cluster) -> int:
    body = {"project": "vision", "name": "kill-bench", "image": "gpuportal/busybox:latest",
            "command": job_command(c.truth, 300), "resources": {"gpus": 1, "cpus": 0.1, "memory_mb": 64},
            "time_limit": 600}
    r = requests.post(f"{c.url}/api/v1/jobs/", json=body, headers=c.headers(), timeout=30)
    assert r.status_code == 201, r.text[:300]
    return r.json()["id"]


def cancel(c: Cluster, job_id: int) -> None:
    requests.post(f"{c.url}/api/v1/jobs/{job_id}/cancel/", headers=c.headers(), timeout=30)


def one_kill(c: Cluster, round_no: int) -> tuple[str, list[float]]:
    jobs = [submit(c) for _ in range(JOBS_PER_ROUND)]
    rows = wait_for(lambda: (r := c.sql("SELECT j.id, j.attempt, n.name FROM jobs_job j JOIN nodes_node n "
                                        "ON n.id = j.node_id WHERE j.id = ANY(%s) AND j.state = 'running'", [jobs]))
                    and len(r) == len(jobs) and r, 120, "the round's jobs to run")
    victim = rows[round_no % len(rows)][2]
    on_victim = {job_id: attempt for job_id, attempt, node in rows if node == victim}
    t0 = time.monotonic()
    c.kill(victim)
    back: dict[int, float] = {}
    while len(back) < len(on_victim):
        for job_id, state, attempt, node in c.sql(
                "SELECT j.id, j.state, j.attempt, n.name FROM jobs_job j LEFT JOIN nodes_node n ON n.id = j.node_id "
                "WHERE j.id = ANY(%s)", [list(on_victim)]):
            if job_id not in back and state == "running" and attempt > on_victim[job_id] and node != victim:
                back[job_id] = time.monotonic() - t0
        if time.monotonic() - t0 > 300:
            raise AssertionError(f"round {round_no}: jobs {set(on_victim) - set(back)} did not run again in 300 s")
        time.sleep(0.1)
    for job_id in jobs:
        cancel(c, job_id)
    c.start_agent(victim)
    wait_for(lambda: all(s in ("cancelled", "succeeded", "failed", "node_fail") for s in
                         c.sql("SELECT state FROM jobs_job WHERE id = ANY(%s)", [jobs], col=0)), 120,
             "the round's jobs to end")
    c.wait_nodes_ready(c.nodes, timeout=120)
    return victim, sorted(back.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--fast", action="store_true", help="the fault suite's timers instead of the defaults")
    args = ap.parse_args()
    timers = TIMERS if args.fast else DEFAULT_TIMERS
    tmp = Path(tempfile.mkdtemp(prefix="gpuportal-killbench-"))
    c = Cluster(tmp, timers=timers)
    figures = []
    try:
        c.start_all()
        for i in range(args.kills):
            victim, times = one_kill(c, i)
            figures.append(max(times))
            print(f"kill {i + 1:2d}: agent of {victim} SIGKILLed; its {len(times)} job(s) running elsewhere after "
                  f"{', '.join(f'{t:.1f}s' for t in times)}", flush=True)
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ntimers: {', '.join(f'{k}={v}' for k, v in timers.items())}")
    print(f"agent SIGKILL -> its jobs running elsewhere, over {len(figures)} kills: "
          f"p50 {statistics.median(figures):.1f}s, max {max(figures):.1f}s, min {min(figures):.1f}s")
    return 0


if __name__ == "__main__":
    if os.environ.get("DJANGO_SETTINGS_MODULE"):
        os.environ.pop("DJANGO_SETTINGS_MODULE")  # the cluster sets its own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so `finally` stops the cluster
    sys.exit(main())
