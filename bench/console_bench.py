"""Admin console page time with 1,000 nodes (8,000 GPUs) and a week of rollups (target < 300 ms).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench .venv/bin/python bench/console_bench.py [--nodes 1000]

Runs in a throwaway database (test_<name>, created with migrations and dropped at the end):
a week of hourly GPU and fleet rollups, 6 hours of minute fleet rollups, the last 30 minutes
of minute GPU rollups, 2,000 running jobs with allocations, a month of usage records for them,
20 unhealthy GPUs. Prints the median and p95 of GET /console/ as staff (server side, through
Django's test client, so without network or browser time).
"""
import argparse
import os
import statistics
import time
from datetime import timedelta

from benchdb import PRODUCTION, django_setup, throwaway_database


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    django_setup(PRODUCTION, SECURE_SSL_REDIRECT="0")  # the test client speaks plain HTTP
    with throwaway_database("gpuportal_bench_console"):
        run(args)


def _copy(model, columns, rows) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        with cursor.cursor.copy(f"COPY {model._meta.db_table} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)


def run(args) -> None:
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.utils import timezone

    from portal.billing.services import usage_meter
    from portal.jobs.models import Allocation, Job
    from portal.metrics.models import FleetRollup, GpuRollup
    from portal.metrics.services import _floor
    from portal.nodes.models import GPU, Node
    from portal.tenancy.models import Project

    t0 = time.perf_counter()
    call_command("seed_demo", stdout=open(os.devnull, "w"))
    now = timezone.now()
    nodes = Node.objects.bulk_create([Node(name=f"gpu-{i:04d}", last_heartbeat_at=now) for i in range(args.nodes)])
    GPU.objects.bulk_create([GPU(node=n, index=j, uuid=f"GPU-{n.name}-{j}", model="H100-80GB", memory_mb=81920)
                             for n in nodes for j in range(8)], batch_size=5000)
    gpu_ids = list(GPU.objects.order_by("pk").values_list("pk", flat=True))
    GPU.objects.filter(pk__in=gpu_ids[:20]).update(health="unhealthy", health_reason="Xid error 79")
    hour0 = _floor(now, 3600) - timedelta(days=7)
    hours = [hour0 + timedelta(hours=h) for h in range(24 * 7 + 1)]
    cols = ("gpu_id", "resolution", "bucket", "samples", "util_avg", "util_max", "memory_used_avg_mb",
            "temperature_max_c", "power_avg_w")
    _copy(GpuRollup, cols, ((g, 3600, h, 360, float((g + k) % 100), 100.0, 4096.0, 70.0, 300.0)
                            for k, h in enumerate(hours) for g in gpu_ids))
    minute0 = _floor(now, 60) - timedelta(minutes=30)
    _copy(GpuRollup, cols, ((g, 60, minute0 + timedelta(minutes=m), 6, float(g % 7), float(g % 7), 4096.0, 70.0,
                             300.0) for m in range(30) for g in gpu_ids))
    fleet = [FleetRollup(resolution=3600, bucket=h, gpus=len(gpu_ids), allocated_gpus=len(gpu_ids) * 0.7,
                         used_gpus=len(gpu_ids) * 0.5, queued_jobs=k % 50, started_jobs=30, wait_avg_s=120.0)
             for k, h in enumerate(hours)]
    fleet += [FleetRollup(resolution=60, bucket=_floor(now, 60) - timedelta(minutes=m), gpus=len(gpu_ids),
                          allocated_gpus=1.0, used_gpus=1.0, queued_jobs=3, started_jobs=1, wait_avg_s=60.0)
              for m in range(360)]
    FleetRollup.objects.bulk_create(fleet)
    alice = get_user_model().objects.get(username="alice")
    vision = Project.objects.get(slug="vision")
    jobs = Job.objects.bulk_create([Job(project=vision, user=alice, name=f"b{i}", image="x", command=["true"],
                                        gpus=1, time_limit_s=86400, state="running") for i in range(2000)])
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0) + timedelta(minutes=5)
    Allocation.objects.bulk_create([Allocation(job=j, attempt=1, gpu_id=gpu_ids[100 + i], started_at=start)
                                    for i, j in enumerate(jobs)])
    usage_meter(now=now)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    setup_s = time.perf_counter() - t0

    client = Client()
    client.force_login(get_user_model().objects.get(username="admin"))
    assert client.get("/console/").status_code == 200  # warm: templates, connection
    times = []
    for _ in range(args.runs):
        t = time.perf_counter()
        r = client.get("/console/")
        times.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 200
    times.sort()
    from portal.billing.models import UsageRecord

    print(f"Console page with {len(nodes)} nodes, {len(gpu_ids)} GPUs, "
          f"{GpuRollup.objects.filter(resolution=3600).count():,} hourly GPU rollups, "
          f"{UsageRecord.objects.count():,} usage records (setup {setup_s:.0f} s, {os.cpu_count()} CPUs)")
    p95 = times[max(0, int(len(times) * 0.95) - 1)]
    mark = "meets" if p95 < 300 else "misses"
    print(f"  GET /console/: median {statistics.median(times):.0f} ms, p95 {p95:.0f} ms over {len(times)} runs "
          f"({mark} the 300 ms target); page {len(r.content) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
