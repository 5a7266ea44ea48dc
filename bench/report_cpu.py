"""Control-plane cost of one job's reports after its start, in one process through the whole Django
stack: SQL queries, Celery messages, pass requests and CPU (this process plus its PostgreSQL
backend) per job, from `assigned` to `succeeded`.

Registers --nodes 8-GPU nodes on a throwaway PostgreSQL database (`gpuportal_bench_reports`),
submits --jobs one-GPU jobs and assigns them with one pass (not measured), then replays what
each node's agent sends for each job with Django's test client (the handler gunicorn calls):
confirm (its launch spec in the answer), the `running` event, one log chunk, and the end, as
single events or, with --batch N, in POST /api/agent/v1/events of N jobs (protocol 1.2, what
an agent sends when many jobs end together). With --at-once, what an agent sends for jobs that end
at once (`true`): the confirmations of each node's launches in one request (protocol 1.7), and
each job's `running` with its end (the agent's running hold), N jobs a request; no log chunk.
Celery messages are counted, not sent; pass
requests go through portal/core/passes.py's coalescing on the Redis REDIS_URL names.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/x REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python bench/report_cpu.py [--jobs 256] [--batch 32] [--at-once] [--profile]

It prints the load average before and after (`os.getloadavg`, what `uptime` shows): on a shared
machine the CPU figures are the ones to compare, wall time follows the load.
"""
import argparse
import os
import time
from collections import Counter

from benchdb import PRODUCTION, backend_cpu_s, django_setup, throwaway_database

django_setup(PRODUCTION)

DB_NAME = "gpuportal_bench_reports"




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=256, help="one-GPU jobs (at most 8 per node)")
    ap.add_argument("--batch", type=int, default=32, help="end reports per request; 1: single events")
    ap.add_argument("--at-once", action="store_true",
                    help="jobs that end at once: batched confirmations, each running with its end")
    ap.add_argument("--profile", nargs="?", const="end", choices=["confirm", "running", "log", "end"],
                    help="print the top functions by cumulative time of one step (default: end)")
    ap.add_argument("--sql", action="store_true", help="print the statements of each step's first request")
    args = ap.parse_args()
    args.jobs = min(args.jobs, args.nodes * 8)

    import json

    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from portal.celery import app
    from portal.core.context import Actor
    from portal.jobs.models import Job
    from portal.jobs.services import job_submit
    from portal.nodes.services import node_add
    from scheduler.adapter import run_pass

    settings.ALLOWED_HOSTS = ["*"]
    messages = Counter()
    app.send_task = lambda name, *a, **k: messages.update([name])  # counted, not sent
    import scheduler.dispatch
    scheduler.dispatch._send = lambda task, node, a, **k: None  # the pass's launches: not part of this path

    with throwaway_database(DB_NAME):
        from django.contrib.auth import get_user_model
        from django.core.management import call_command

        call_command("seed_demo", stdout=open(os.devnull, "w"))
        alice = get_user_model().objects.get(username="alice")
        from portal.tenancy.models import Organization, Quota

        Quota.objects.filter(project__slug="vision").update(max_gpus=args.jobs, guaranteed_gpus=args.jobs,
                                                          max_running_jobs=None, gpu_hours_budget=None)
        Organization.objects.update(max_gpus=None)
        client = Client()
        agents = {}
        for i in range(args.nodes):
            name = f"rep-{i:03d}"
            node, token = node_add(actor=Actor(user=None, label="manage.py"), name=name, gpus="8xH100-80GB")
            auth = f"Bearer {token}"
            body = {"name": name, "cpus": 64, "memory_mb": 512000, "sandbox": "process",
                    "gpus": [{"index": g, "uuid": f"GPU-{i:03d}-{g}", "model": "NVIDIA H100 80GB HBM3",
                              "memory_mb": 81559} for g in range(8)]}
            r = client.post("/api/agent/v1/register", json.dumps(body), content_type="application/json",
                            HTTP_AUTHORIZATION=auth, secure=True)
            assert r.status_code == 200, r.content
            node.refresh_from_db()
            if node.queue_probe:  # the agent answers the probe it got on its queue: the node takes jobs
                r = client.post("/api/agent/v1/probe", json.dumps({"nonce": node.queue_probe}),
                                content_type="application/json", HTTP_AUTHORIZATION=auth, secure=True)
                assert r.status_code == 200, r.content
            agents[node.pk] = auth
        for i in range(args.jobs):
            job_submit(actor=Actor(user=alice), data={"project": "vision", "name": f"r{i}", "image":
                       "gpuportal/busybox:latest", "command": ["true"], "resources": {"gpus": 1}})
        run_pass()
        jobs = list(Job.objects.filter(state="assigned").values_list("pk", "attempt", "node_id"))
        if len(jobs) != args.jobs:
            raise SystemExit(f"{len(jobs)} of {args.jobs} jobs assigned: {set(Job.objects.values_list('state', 'reason_message'))}")
        messages.clear()

        def post(path, body, auth):
            r = client.post(f"/api/agent/v1/{path}", json.dumps(body), content_type="application/json",
                            HTTP_AUTHORIZATION=auth, secure=True)
            if r.status_code != 200:
                raise SystemExit(f"{path} answered {r.status_code}: {r.content[:300]!r}")
            return r.json()

        steps = {}
        profiles = []

        def step(name, calls, key):
            profiler = None
            if args.profile == key:
                import cProfile

                profiler = cProfile.Profile(time.process_time)  # CPU, not the waits on PostgreSQL
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                backend = cursor.fetchone()[0]
            before = dict(messages)
            connection.queries_log.clear()  # a bounded deque: a full one would count short
            db0, c0, w0 = (backend_cpu_s(backend) or 0.0), time.process_time(), time.perf_counter()
            if profiler:
                profiler.enable()
            with CaptureQueriesContext(connection) as queries:
                calls[0]()
                head = list(queries)
                for call in calls[1:]:
                    call()
            if profiler:
                profiler.disable()
                profiles.append(profiler)
            steps[name] = {"cpu": time.process_time() - c0, "db": (backend_cpu_s(backend) or 0.0) - db0,
                           "wall": time.perf_counter() - w0, "queries": len(queries),
                           "messages": sum(messages.values()) - sum(before.values())}
            if args.sql:
                print(f"-- {name}: the first request's statements")
                for q in head:
                    print("  ", q["sql"][:200])

        by_node = {}
        for pk, a, n in jobs:
            by_node.setdefault(n, []).append((pk, a))
        if args.at_once:
            step(f"confirms (batches of up to {args.batch})", [
                lambda cs=cs[i:i + args.batch], n=n: post(
                    "confirms", {"confirms": [{"job_id": str(pk), "attempt": a} for pk, a in cs]}, agents[n])
                for n, cs in by_node.items() for i in range(0, len(cs), args.batch)], "confirm")
            ends = [lambda cs=cs[i:i + args.batch], n=n: post("events", {"events": [
                e for pk, a in cs for e in ({"job_id": str(pk), "attempt": a, "state": "running"},
                                            {"job_id": str(pk), "attempt": a, "state": "succeeded", "exit_code": 0})]},
                agents[n]) for n, cs in by_node.items() for i in range(0, len(cs), args.batch)]
            step(f"running with its end (batches of up to {args.batch} jobs)", ends, "end")
        else:
            _steps_apart(args, jobs, by_node, post, step, agents)
        left = Job.objects.filter(pk__in=[pk for pk, _, _ in jobs]).exclude(state="succeeded").count()
        if left:
            raise SystemExit(f"{left} jobs did not succeed")
        _print(args, jobs, steps, messages, profiles)


def _steps_apart(args, jobs, by_node, post, step, agents):
    """confirm, running, a log chunk and the end, each in requests of its own."""
    step("confirm (launch spec)", [lambda pk=pk, a=a, n=n: post(f"jobs/{pk}/confirm", {"attempt": a}, agents[n])
                                           for pk, a, n in jobs], "confirm")
    step("running event", [lambda pk=pk, a=a, n=n: post(f"jobs/{pk}/events", {"attempt": a, "state": "running"},
                                                      agents[n]) for pk, a, n in jobs], "running")
    step("one log chunk", [lambda pk=pk, a=a, n=n: post(f"jobs/{pk}/logs", {"attempt": a, "offset": 0,
                                                                           "data": "done\n"}, agents[n])
                           for pk, a, n in jobs], "log")
    if args.batch <= 1:
        ends = [lambda pk=pk, a=a, n=n: post(f"jobs/{pk}/events", {"attempt": a, "state": "succeeded",
                                                                  "exit_code": 0}, agents[n])
                for pk, a, n in jobs]
    else:
        ends = [lambda cs=cs[i:i + args.batch], n=n: post("events", {"events": [
            {"job_id": str(pk), "attempt": a, "state": "succeeded", "exit_code": 0} for pk, a in cs]}, agents[n])
            for n, cs in by_node.items() for i in range(0, len(cs), args.batch)]
    step(f"end ({'single events' if args.batch <= 1 else f'batches of up to {args.batch}'}, {len(ends)} requests)",
         ends, "end")


def _print(args, jobs, steps, messages, profiles):
    n = len(jobs)
    print(f"{n} one-GPU jobs on {args.nodes} x 8 GPUs; per job:")
    print(f"  {'step':46} {'queries':>7} {'msgs':>5} {'CPU ms':>7} {'(web':>6} {'+ PG)':>6} {'wall ms':>8}")
    total = Counter()
    for name, s in steps.items():
        total.update(s)
        print(f"  {name:46} {s['queries'] / n:7.2f} {s['messages'] / n:5.2f} {(s['cpu'] + s['db']) * 1e3 / n:7.2f} "
              f"{s['cpu'] * 1e3 / n:6.2f} {s['db'] * 1e3 / n:6.2f} {s['wall'] * 1e3 / n:8.2f}")
    print(f"  {'all':46} {total['queries'] / n:7.2f} {total['messages'] / n:5.2f} "
          f"{(total['cpu'] + total['db']) * 1e3 / n:7.2f} {total['cpu'] * 1e3 / n:6.2f} "
          f"{total['db'] * 1e3 / n:6.2f} {total['wall'] * 1e3 / n:8.2f}")
    print(f"  Celery messages: {dict(messages) or 'none'}")
    for profiler in profiles:
        import pstats

        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    load0 = os.getloadavg()
    main()
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
