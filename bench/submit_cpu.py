"""Control-plane cost of one single submit (POST /api/v1/jobs/ with a Bearer token), in one
process through the whole Django stack with production settings: SQL statements, and CPU of
this process and of its PostgreSQL backend per submit.

Seeds the demo tenant on a throwaway PostgreSQL database (`gpuportal_bench_submit`), issues
alice a token, and submits --jobs one-GPU jobs to `vision` with Django's test client (the
handler gunicorn calls); pass requests are counted, not sent. With --budget the project keeps
a GPU-hour budget, whose check adds two reads. --profile prints the top functions.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/x REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python bench/submit_cpu.py [--jobs 300] [--budget] [--profile]

It prints the load average before and after: on a shared machine compare the CPU figures.
"""
import argparse
import json
import os
import time

from benchdb import PRODUCTION, backend_cpu_s, django_setup, throwaway_database

django_setup(PRODUCTION)

DB_NAME = "gpuportal_bench_submit"




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--budget", action="store_true", help="keep the project's GPU-hour budget")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from portal.celery import app

    settings.ALLOWED_HOSTS = ["*"]
    app.send_task = lambda *a, **k: None  # the pass a submit asks for: not part of this path

    with throwaway_database(DB_NAME):
        from django.contrib.auth import get_user_model
        from django.core.management import call_command

        from portal.accounts.services import token_issue
        from portal.core.context import Actor
        from portal.tenancy.models import Organization, Quota

        call_command("seed_demo", stdout=open(os.devnull, "w"))
        alice = get_user_model().objects.get(username="alice")
        Quota.objects.filter(project__slug="vision").update(
            max_gpus=50000, max_running_jobs=None, **({} if args.budget else {"gpu_hours_budget": None}))
        Organization.objects.update(max_gpus=None)
        _, secret = token_issue(actor=Actor(user=alice), user=alice, name="bench", scopes=["read", "submit"])
        client = Client()
        body = json.dumps({"project": "vision", "name": "bench", "image": "gpuportal/busybox:latest",
                           "command": ["true"], "resources": {"gpus": 1, "cpus": 0.1, "memory_mb": 64},
                           "time_limit": 600})

        def submit():
            r = client.post("/api/v1/jobs/", body, content_type="application/json",
                            HTTP_AUTHORIZATION=f"Bearer {secret}", secure=True)
            if r.status_code != 201:
                raise SystemExit(f"submit answered {r.status_code}: {r.content[:300]!r}")

        for _ in range(20):  # warm: imports, caches, the connection
            submit()
        with CaptureQueriesContext(connection) as capture:
            submit()
        queries = list(capture)  # now: each request clears the connection's query log at its start
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend = cursor.fetchone()[0]
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        db0, c0, w0 = (backend_cpu_s(backend) or 0.0), time.process_time(), time.perf_counter()
        for _ in range(args.jobs):
            submit()
        cpu, db, wall = time.process_time() - c0, (backend_cpu_s(backend) or 0.0) - db0, time.perf_counter() - w0
        if profiler:
            profiler.disable()
        n = args.jobs
        print(f"{n} submits ({'with' if args.budget else 'without'} a GPU-hour budget); per submit:")
        print(f"  statements {len(queries)}; CPU {(cpu + db) * 1e3 / n:.2f} ms (web {cpu * 1e3 / n:.2f} + "
              f"PostgreSQL {db * 1e3 / n:.2f}); wall {wall * 1e3 / n:.2f} ms")
        for q in queries:
            print("   ", q["sql"][:110])
        if profiler:
            import pstats

            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    load0 = os.getloadavg()
    main()
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
