"""One full scheduling pass against PostgreSQL at scale, apply included.

10,000 queued jobs of mixed sizes, 1,000 nodes x 8 GPUs with about half the GPUs busy.
Builds a throwaway database `gpuportal_bench` on the DATABASE_URL server, fills it with bulk inserts,
then times `scheduler.adapter.run_pass()`: snapshot build, core, apply, commit.

    DEBUG=1 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/sched_full_pass.py
Target (issue #3): under 5 s.
"""
import os
import random
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ.setdefault("DEBUG", "1")
os.environ.setdefault("LAUNCH_RESEND_S", "3600")  # measure passes, not re-sends of the first pass
os.environ.setdefault("LAUNCH_LOST_S", "7200")  # must exceed LAUNCH_RESEND_S

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from benchdb import throwaway_database  # noqa: E402
from django.utils import timezone  # noqa: E402

NODES, GPUS_PER_NODE, QUEUED = 1000, 8, 10_000


def fill():
    from django.contrib.auth import get_user_model

    from portal.jobs.models import Allocation, Job
    from portal.nodes.models import GPU, Node
    from portal.tenancy.models import Organization, Project, Quota

    call_command("seed_demo", stdout=open(os.devnull, "w"))
    Quota.objects.update(guaranteed_gpus=Decimal(3000), max_gpus=Decimal(8000), max_running_jobs=None,
                         gpu_hours_budget=None)
    Organization.objects.update(max_gpus=None)
    projects = list(Project.objects.all())
    users = {p.pk: get_user_model().objects.filter(memberships__project=p, memberships__role__in=["owner", "member"])
             .first() for p in projects}
    nodes = Node.objects.bulk_create([Node(name=f"n{i:04d}", state="ready", last_heartbeat_at=timezone.now(),
                                           queue_verified_at=timezone.now())  # takes jobs (Node.schedulable)
                                      for i in range(NODES)])
    gpus = GPU.objects.bulk_create([GPU(node=n, index=g, uuid=f"GPU-{uuid.uuid4()}", model="H100-80GB",
                                        memory_mb=81920) for n in nodes for g in range(GPUS_PER_NODE)])
    rng = random.Random(7)
    sizes = [1] * 50 + [2] * 20 + [4] * 15 + [8] * 10 + [16] * 5
    now = timezone.now()
    # Half the fleet busy: one 4-GPU running job on every node's first half.
    running = Job.objects.bulk_create([
        Job(project=projects[i % 2], user=users[projects[i % 2].pk], name="busy", image="x", command=["true"],
            gpus=4, time_limit_s=rng.choice([3600, 4 * 3600, 86400]), state="running", started_at=now)
        for i in range(NODES)])
    Allocation.objects.bulk_create([
        Allocation(job=job, attempt=1, gpu=gpus[i * GPUS_PER_NODE + g], started_at=now)
        for i, job in enumerate(running) for g in range(4)])
    Job.objects.bulk_create([
        Job(project=projects[i % 2], user=users[projects[i % 2].pk], name=f"q{i}", image="x", command=["true"],
            gpus=rng.choice(sizes), time_limit_s=rng.choice([600, 3600, 4 * 3600, 86400]),
            priority=rng.choice(["low", "normal", "normal", "high"]), reason_code="new")
        for i in range(QUEUED)], batch_size=2000)


def main():
    from scheduler.adapter import run_pass

    with throwaway_database("gpuportal_bench") as name:
        t0 = time.perf_counter()
        fill()
        print(f"filled {NODES} nodes x {GPUS_PER_NODE} GPUs, {NODES} running, {QUEUED} queued "
              f"in {time.perf_counter() - t0:.1f}s (database {name})")
        for i in range(3):
            t = time.perf_counter()
            if i == 2 and os.environ.get("PROFILE"):
                import cProfile
                import pstats

                profile = cProfile.Profile()
                result = profile.runcall(run_pass)
                pstats.Stats(profile).sort_stats("cumtime").print_stats(40)
            else:
                result = run_pass()
            print(f"pass {i + 1}: {time.perf_counter() - t:.2f}s total  build {result['build_s']:.2f}s  "
                  f"core {result['core_s']:.2f}s  apply {result['apply_s']:.2f}s  commit+publish {result['commit_publish_s']:.2f}s  started {result['started']}  waiting {result['waiting']}  "
                  f"reasons written {result['reasons_written']}")


if __name__ == "__main__":
    main()
