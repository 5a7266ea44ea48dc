"""Where PostgreSQL's time goes per job: `bench/vs_portal.py`'s installation (16 nodes x 8 simulated
GPUs, process sandbox, gunicorn with 4 workers, production settings) with pg_stat_statements, N
one-GPU `true` jobs from one serial client; prints statements, execution and planning time per job,
in all and for the costliest statements.

    .venv/bin/python bench/pg_statements.py [--jobs 400] [--top 25]

Planning is counted with pg_stat_statements.track_planning; a statement prepared on the server
(DB_PREPARE_THRESHOLD) is planned once per connection, or not at all once PostgreSQL keeps its
generic plan.
"""
import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import psycopg
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.faults.cluster as fc  # noqa: E402
from vs_portal import GPUS_PER_NODE, NODES, TIMERS, production  # noqa: E402 (bench/ is on the path)
from tests.procs import wait_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    fc.AGENTS, fc.GPUS_PER_AGENT = NODES, GPUS_PER_NODE
    fc.netns.available = lambda: "the bench runs every agent on loopback"
    tmp = Path(tempfile.mkdtemp(prefix="pg-statements-"))
    c = fc.Cluster(tmp, timers=TIMERS)
    production(c)
    admin = c.dsn.replace("dbname=gpuportal", "dbname=postgres")
    try:
        c.start_postgres()  # once to set the extension up (each setting needs its own restart)
        for setting in ("shared_preload_libraries = 'pg_stat_statements'", "pg_stat_statements.track_planning = on"):
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"ALTER SYSTEM SET {setting}")
            c.stop_postgres()
            c.start_postgres()
        c.stop_postgres()
        c.start_all()
        c.sql("UPDATE tenancy_quota SET max_gpus = %s, max_running_jobs = NULL WHERE project_id = "
              "(SELECT id FROM tenancy_project WHERE slug = 'vision') RETURNING id", (NODES * GPUS_PER_NODE,))
        c.sql("UPDATE tenancy_organization SET max_gpus = NULL RETURNING id")
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        body = {"project": "vision", "name": "pg-statements", "image": "gpuportal/busybox:latest",
                "command": ["true"], "resources": {"gpus": 1, "cpus": 0.1, "memory_mb": 64}, "time_limit": 600}
        session = requests.Session()
        session.headers.update(c.headers())
        for _ in range(args.jobs):
            r = session.post(f"{c.url}/api/v1/jobs/", json=body, timeout=60)
            assert r.status_code == 201, r.text[:300]
        wait_for(lambda: c.sql("SELECT count(*) FROM jobs_job WHERE state NOT IN ('succeeded', 'failed', "
                               "'cancelled', 'timeout', 'node_fail', 'oom')", col=0)[0] == 0, 600, "every job to end")
        n = args.jobs
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            calls, exec_ms, plan_ms = conn.execute(
                "SELECT sum(calls), sum(total_exec_time), sum(total_plan_time) FROM pg_stat_statements").fetchone()
            top = conn.execute(
                "SELECT calls, total_exec_time, total_plan_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 100) "
                "FROM pg_stat_statements ORDER BY total_exec_time + total_plan_time DESC LIMIT %s", (args.top,)).fetchall()
        print(f"{n} jobs: {calls / n:.1f} statements a job; execution {exec_ms / n:.2f} ms, planning {plan_ms / n:.2f} ms a job")
        for calls, ex, pl, query in top:
            print(f"{calls / n:6.2f}/job  exec {ex / n:6.3f}  plan {pl / n:6.3f} ms/job  {query}")
        return 0
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
