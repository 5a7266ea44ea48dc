"""The portal's half of bench/vs_slurm.sh: N one-GPU `true` jobs on 16 nodes x 8 simulated GPUs.

Starts an installation of its own (tests/faults/cluster.py: a throwaway PostgreSQL and Redis,
gunicorn with 4 workers, a Celery worker and beat, 16 process-sandbox agents with 8 simulated
GPUs each, the portal's default timers), submits N jobs by one serial HTTP client, waits until
every job has ended, and prints one JSON line:

- submit_rate_jobs_s: N / the client's wall time;
- makespan_s: first submit to last end (the database's submitted_at and ended_at);
- passes: the scheduling passes that ran meanwhile and found something changed (the worker's log;
  one that finds nothing changed logs at debug level only);
- cpu_s: CPU seconds during the run of the control plane (gunicorn, the worker, beat, Redis,
  PostgreSQL) and of the agents (their process groups; jobs run in sessions of their own);
  jobs: what the agents' reaped children took, each job's supervisor (the process
  sandbox's job parent, forked by the agent's spawner, which reaps it) and the job itself (`true`).

    .venv/bin/python bench/vs_portal.py [--jobs 1000]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.faults.cluster as fc  # noqa: E402
from tests.procs import wait_for  # noqa: E402

NODES, GPUS_PER_NODE = 16, 8
PASS_LINE = "scheduling pass: "  # the worker's line for each pass that found something changed
TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pids, reaped: tuple[int, ...] = (), own: bool = True) -> float:
    """CPU seconds of `pids` (with `own` False: none of their own); for those in `reaped`, with their
    reaped children's (a PostgreSQL backend that exits during the run is counted in its postmaster's
    cutime and cstime)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if own:
            total += (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        if pid in reaped:
            total += (int(fields[13]) + int(fields[14])) / TICK  # cutime, cstime
    return total


def children_cpu(pids) -> float:
    """CPU seconds of the reaped children of `pids` (cutime, cstime)."""
    return cpu_of(pids, tuple(pids), own=False)


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(entry)] = (int(fields[1]), int(fields[2]))
    return out


def postmaster(c: fc.Cluster) -> int:
    return int((c.pgdata / "postmaster.pid").read_text().split()[0])


def groups(c: fc.Cluster) -> dict[str, list[int]]:
    """The pids of each part, now: process groups the cluster started, and PostgreSQL's server and backends."""
    procs = processes()
    parts: dict[str, list[int]] = {"control": [], "agents": []}
    for key, (proc, _) in c.procs.items():
        members = [pid for pid, (_, pgid) in procs.items() if pgid == proc.pid]
        parts["agents" if key.startswith("fault-") else "control"] += members
        if not key.startswith("fault-"):
            parts[f"control.{key}"] = members
    pg = postmaster(c)
    parts["control.postgres"] = [pg] + [pid for pid, (ppid, _) in procs.items() if ppid == pg]
    parts["control"] += parts["control.postgres"]
    return parts


# The portal's default timers (the fault suite's are short, to make its faults quick).
TIMERS = {"NODE_HEARTBEAT_INTERVAL_S": "5", "AGENT_LEASE_S": "15", "AGENT_FENCE_GRACE_S": "3",
          "NODE_TIMEOUT_S": "20", "NODE_REAP_INTERVAL_S": "5", "LAUNCH_RESEND_S": "60"}


def production(c: fc.Cluster) -> None:
    """Production settings (the fault suite runs with DEBUG on, whose query log costs CPU of its own),
    over plain HTTP on loopback as gunicorn behind nginx sees it: 4 workers of deploy/gunicorn.conf.py's
    default 2 threads, which keep a client's connection open between requests (as nginx's upstream
    keepalive does), where one thread (a sync worker) closed it after each."""
    c.env.pop("GUNICORN_THREADS", None)
    c.env.update({"GUNICORN_WORKERS": "4", "LOG_LEVEL": "WARNING", "DEBUG": "0",
                  "SECRET_KEY": "vs-slurm-" + "abcdefghij" * 6, "ALLOWED_HOSTS": "127.0.0.1,localhost",
                  "SECURE_SSL_REDIRECT": "0", "SESSION_COOKIE_SECURE": "0", "CSRF_COOKIE_SECURE": "0"})


def lift_caps(c: fc.Cluster) -> None:
    """The demo tenant caps `vision` at 16 GPUs and 20 running jobs; Slurm's side has no limits, so
    neither has this one: the whole 16 x 8 GPUs are the project's (its GPU-hour budget stays)."""
    c.sql("UPDATE tenancy_quota SET max_gpus = %s, max_running_jobs = NULL WHERE project_id = "
          "(SELECT id FROM tenancy_project WHERE slug = 'vision') RETURNING id", (NODES * GPUS_PER_NODE,))
    c.sql("UPDATE tenancy_organization SET max_gpus = NULL RETURNING id")


def submit_all(c: fc.Cluster, jobs: int) -> None:
    """`jobs` one-GPU `true` jobs to `vision`, one POST after the other, as alice."""
    body = {"project": "vision", "name": "vs-slurm", "image": "gpuportal/busybox:latest", "command": ["true"],
            "resources": {"gpus": 1, "cpus": 0.1, "memory_mb": 64}, "time_limit": 600}
    session = requests.Session()
    session.headers.update(c.headers())
    for _ in range(jobs):
        r = session.post(f"{c.url}/api/v1/jobs/", json=body, timeout=60)
        assert r.status_code == 201, r.text[:300]


def ended(c: fc.Cluster) -> int:
    return c.sql("SELECT count(*) FROM jobs_job WHERE state IN "
                 "('succeeded', 'failed', 'cancelled', 'timeout', 'node_fail', 'oom')", col=0)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    args = parser.parse_args()
    fc.AGENTS, fc.GPUS_PER_AGENT = NODES, GPUS_PER_NODE
    fc.netns.available = lambda: "the bench runs every agent on loopback"
    tmp = Path(tempfile.mkdtemp(prefix="vs-portal-"))
    c = fc.Cluster(tmp, timers=TIMERS)
    production(c)
    try:
        t = time.perf_counter()
        c.start_all()
        print(f"installation up in {time.perf_counter() - t:.0f}s ({NODES} nodes x {GPUS_PER_NODE} GPUs)",
              file=sys.stderr)
        lift_caps(c)
        # Backends and gunicorn workers that exit during the run are counted by their parents.
        reaped = (postmaster(c), c.procs["web"][0].pid)
        before = {k: cpu_of(v, reaped) for k, v in groups(c).items()}
        # The agents' groups hold each agent and its process spawner, which reaps the jobs' supervisors.
        jobs_before = children_cpu(groups(c)["agents"])
        passes_before = c.log("worker").count(PASS_LINE)
        t0 = time.perf_counter()
        submit_all(c, args.jobs)
        submit_s = time.perf_counter() - t0
        wait_for(lambda: ended(c) >= args.jobs, 1800, "every job to end")
        wall_s = time.perf_counter() - t0
        after = {k: cpu_of(v, reaped) for k, v in groups(c).items() if k in before}
        after["jobs"] = children_cpu(groups(c)["agents"]) - jobs_before
        (makespan, succeeded), = c.sql("SELECT extract(epoch FROM max(ended_at) - min(submitted_at)), "
                                       "count(*) FILTER (WHERE state = 'succeeded') FROM jobs_job")
        cpu = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
        # Where a job's time went: submit to assigned (the pass), assigned to running (publish,
        # confirm, start), running to its end (the exit noticed and reported); p50 and p95 in s.
        phases = c.sql(
            "SELECT percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (ORDER BY extract(epoch FROM a.at - j.submitted_at)), "
            "percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (ORDER BY extract(epoch FROM r.at - a.at)), "
            "percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (ORDER BY extract(epoch FROM j.ended_at - r.at)) "
            "FROM jobs_job j JOIN jobs_jobevent a ON a.job_id = j.id AND a.state = 'assigned' "
            "JOIN jobs_jobevent r ON r.job_id = j.id AND r.state = 'running'")[0]
        print(json.dumps({
            "bench": "gpuportal", "nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "jobs": args.jobs,
            "succeeded": succeeded, "submit_s": round(submit_s, 2),
            "submit_rate_jobs_s": round(args.jobs / submit_s, 1), "makespan_s": round(float(makespan), 2),
            "wall_until_done_s": round(wall_s, 2), "passes": c.log("worker").count(PASS_LINE) - passes_before,
            "cpu_s": cpu,
            "p50_p95_s": {name: [round(float(v), 3) for v in values] for name, values in zip(
                ("submit_to_assigned", "assigned_to_running", "running_to_end"), phases)},
            "cpu_ms_per_job": {k: round(v * 1000 / args.jobs, 1) for k, v in cpu.items()},
        }))
        return 0
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
