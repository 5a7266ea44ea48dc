"""Does a pass, or a submit's budget check, grow with the month's history? (issue 14)

For each history size (allocations released this month, spread over the demo's projects), a
throwaway database gets 16 nodes x 8 GPUs, half of them busy, and 500 queued jobs; the history is
folded into the running usage totals once (what the first pass after the upgrade does), then:
- `pass`: a steady scheduling pass (median of 5), its snapshot build alone, and
- `budget`: the submit-time read gpu_hours_used_this_month (median of 20),
- `scan`: what both read before the totals, every allocation of the month into Python (median of 5).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/sched_history.py [1000 100000]
"""
import os
import random
import statistics
import sys
import time
import uuid
from datetime import timedelta
from decimal import Decimal

from benchdb import DEVELOPMENT, django_setup, throwaway_database

django_setup(DEVELOPMENT, LAUNCH_RESEND_S="3600", LAUNCH_LOST_S="7200")  # LOST must exceed RESEND
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

NODES, GPUS_PER_NODE, QUEUED = 16, 8, 500


def fill(history: int):
    from django.contrib.auth import get_user_model

    from portal.jobs.models import Allocation, Job
    from portal.nodes.models import GPU, Node
    from portal.tenancy.models import Organization, Project, Quota

    call_command("seed_demo", stdout=open(os.devnull, "w"))
    Quota.objects.update(guaranteed_gpus=Decimal(64), max_gpus=Decimal(128), max_running_jobs=None,
                         gpu_hours_budget=Decimal(10 ** 7))
    Organization.objects.update(max_gpus=None)
    projects = list(Project.objects.all())
    users = {p.pk: get_user_model().objects.filter(memberships__project=p).first() for p in projects}
    now = timezone.now()
    nodes = Node.objects.bulk_create([Node(name=f"n{i:02d}", state="ready", last_heartbeat_at=now,
                                           queue_verified_at=now, sandbox="process") for i in range(NODES)])
    gpus = GPU.objects.bulk_create([GPU(node=n, index=g, uuid=f"GPU-{uuid.uuid4()}", model="H100-80GB",
                                        memory_mb=81920) for n in nodes for g in range(GPUS_PER_NODE)])
    rng = random.Random(7)
    # The month's history: one ended job per allocation, all since the month began.
    since = max((now - now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)).total_seconds(), 3600)
    ended = Job.objects.bulk_create([
        Job(project=projects[i % len(projects)], user=users[projects[i % len(projects)].pk], name="old", image="x",
            command=["true"], gpus=1, time_limit_s=3600, state="succeeded", sandbox="process")
        for i in range(history)], batch_size=5000)
    allocs = []
    for job in ended:
        start = now - timedelta(seconds=rng.uniform(60, since))
        allocs.append(Allocation(job=job, attempt=1, gpu=rng.choice(gpus), shared=True, started_at=start,
                                 released_at=start + timedelta(seconds=rng.uniform(1, 60))))
    Allocation.objects.bulk_create(allocs, batch_size=5000)
    running = Job.objects.bulk_create([
        Job(project=projects[i % 2], user=users[projects[i % 2].pk], name="busy", image="x", command=["true"],
            gpus=4, time_limit_s=86400, state="running", started_at=now, sandbox="process") for i in range(NODES)])
    Allocation.objects.bulk_create([Allocation(job=job, attempt=1, gpu=gpus[i * GPUS_PER_NODE + g], started_at=now)
                                    for i, job in enumerate(running) for g in range(4)])
    Job.objects.bulk_create([
        Job(project=projects[i % 2], user=users[projects[i % 2].pk], name=f"q{i}", image="x", command=["true"],
            gpus=8, time_limit_s=3600, reason_code="new", sandbox="process") for i in range(QUEUED)])
    return [p.pk for p in projects]


def scan(project_ids):
    """The month's allocations into Python, as the selectors did before the running totals."""
    from django.db.models import Q

    from portal.jobs.models import Allocation
    from portal.jobs.selectors import month_start

    now = timezone.now()
    start = month_start(now)
    total = 0.0
    for _, started, released, fraction in Allocation.objects.filter(job__project_id__in=project_ids).filter(
            Q(released_at__isnull=True) | Q(released_at__gt=start)).values_list(
            "job__project_id", "started_at", "released_at", "fraction"):
        total += max(0.0, ((released or now) - max(started, start)).total_seconds()) * float(fraction)
    return total


def median_s(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    from portal.jobs.selectors import gpu_hours_used_this_month
    from portal.jobs.usage import usage_fold
    from scheduler.adapter import run_pass

    sizes = [int(a) for a in sys.argv[1:]] or [1000, 100_000]
    for history in sizes:
        with throwaway_database("gpuportal_bench_history"):
            t = time.perf_counter()
            project_ids = fill(history)
            filled = time.perf_counter() - t
            t = time.perf_counter()
            folded = usage_fold()
            fold_s = time.perf_counter() - t
            with connection.cursor() as cursor:
                cursor.execute("VACUUM ANALYZE")  # as autovacuum would have, after the bulk writes
                if os.environ.get("EXPLAIN"):
                    from portal.jobs.selectors import untallied_allocations

                    cursor.execute("EXPLAIN ANALYZE " + str(untallied_allocations(project_ids[:1]).query))
                    print("\n".join(r[0] for r in cursor.fetchall()))
            run_pass()  # the first pass starts what fits; later ones start nothing
            results = []
            pass_s = median_s(lambda: results.append(run_pass()), 5)
            build_s = statistics.median(r["build_s"] for r in results)
            budget_s = median_s(lambda: gpu_hours_used_this_month(project_ids[:1]), 20)
            scan_s = median_s(lambda: scan(project_ids), 5)
            print(f"history {history:>7} allocations this month (filled in {filled:.0f}s, folded {folded} in "
                  f"{fold_s:.2f}s): pass {pass_s * 1000:.0f} ms (snapshot {build_s * 1000:.0f} ms)  "
                  f"budget read {budget_s * 1000:.2f} ms  | scan as before {scan_s * 1000:.0f} ms")


if __name__ == "__main__":
    main()
