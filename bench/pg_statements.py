"""Where PostgreSQL's time goes per job: `bench/vs_portal.py`'s installation (16 nodes x 8 simulated
GPUs, process sandbox, gunicorn with 4 workers, production settings) with pg_stat_statements, N
one-GPU `true` jobs from one serial client; prints statements, execution and planning time per job,
in all and for the costliest statements (with the share of their calls PostgreSQL planned: a
prepared statement it keeps a generic plan for is not planned again).

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.faults.cluster as fc  # noqa: E402
import vs_portal  # noqa: E402 (bench/ is on the path)
from tests.procs import wait_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    fc.AGENTS, fc.GPUS_PER_AGENT = vs_portal.NODES, vs_portal.GPUS_PER_NODE
    fc.netns.available = lambda: "the bench runs every agent on loopback"
    tmp = Path(tempfile.mkdtemp(prefix="pg-statements-"))
    c = fc.Cluster(tmp, timers=vs_portal.TIMERS)
    vs_portal.production(c)
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
        vs_portal.lift_caps(c)
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        vs_portal.submit_all(c, args.jobs)
        wait_for(lambda: vs_portal.ended(c) >= args.jobs, 600, "every job to end")
        n = args.jobs
        with psycopg.connect(c.dsn, autocommit=True) as conn:
            calls, exec_ms, plan_ms = conn.execute(
                "SELECT sum(calls), sum(total_exec_time), sum(total_plan_time) FROM pg_stat_statements").fetchone()
            top = conn.execute(
                "SELECT calls, plans, total_exec_time, total_plan_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 100) "
                "FROM pg_stat_statements ORDER BY total_exec_time + total_plan_time DESC LIMIT %s", (args.top,)).fetchall()
        print(f"{n} jobs: {calls / n:.1f} statements a job; execution {exec_ms / n:.2f} ms, planning {plan_ms / n:.2f} ms a job")
        for calls, plans, ex, pl, query in top:
            print(f"{calls / n:6.2f}/job  exec {ex / n:6.3f}  plan {pl / n:6.3f} ms/job  planned {plans / calls:4.0%}  {query}")
        return 0
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
