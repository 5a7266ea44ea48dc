"""The CPU of the passes bench/vs_portal.py runs: a few jobs in, a few out, each pass starting one or two.

16 nodes x 8 GPUs with 16 one-GPU jobs running (bench/vs_portal.py's cluster under its stream of
`true` jobs, which end as they start). Each round submits two jobs, ends two running ones (their allocations released), and
runs `scheduler.adapter.run_pass()`, publishing included; ROUNDS rounds (default 200). Prints the
CPU per pass of this process (the worker's part) and of its PostgreSQL backend, and how the pass's
wall time splits. The worker's CPU per job in bench/vs_portal.py is about passes x this / jobs.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/sched_small_pass.py
PROFILE=cumtime (or tottime) profiles the rounds' CPU; BENCH_DB names the throwaway database
(default gpuportal_bench_small), so two runs on one server do not collide.
"""
import os
import time
import uuid
from decimal import Decimal

from benchdb import PRODUCTION, backend_cpu_s, django_setup, throwaway_database

# As bench/vs_portal.py runs the worker: production settings (DEBUG off; DEBUG=1 in the environment
# adds the query log's CPU of its own).
django_setup(PRODUCTION)

from django.core.management import call_command  # noqa: E402
from django.utils import timezone  # noqa: E402

from agents.protocol import PROTOCOL_VERSION  # noqa: E402

NODES, GPUS_PER_NODE, RUNNING = 16, 8, 16


def fill():
    from django.contrib.auth import get_user_model

    from portal.jobs.models import Allocation, Job
    from portal.nodes.models import GPU, Node
    from portal.tenancy.models import Organization, Project, Quota

    call_command("seed_demo", stdout=open(os.devnull, "w"))
    Quota.objects.update(guaranteed_gpus=Decimal(128), max_gpus=Decimal(1000), max_running_jobs=None,
                         gpu_hours_budget=None)
    Organization.objects.update(max_gpus=None)
    project = Project.objects.get(slug="vision")
    user = get_user_model().objects.filter(memberships__project=project, memberships__role__in=["owner", "member"]
                                           ).first()
    now = timezone.now()
    nodes = Node.objects.bulk_create([Node(name=f"s{i:02d}", state="ready", last_heartbeat_at=now,
                                           queue_verified_at=now, protocol_version=PROTOCOL_VERSION, cpus=64,
                                           memory_mb=512_000) for i in range(NODES)])
    gpus = GPU.objects.bulk_create([GPU(node=n, index=g, uuid=f"GPU-{uuid.uuid4()}", model="H100-80GB",
                                        memory_mb=81920) for n in nodes for g in range(GPUS_PER_NODE)])
    running = Job.objects.bulk_create([
        Job(project=project, user=user, name="busy", image="x", command=["true"], gpus=1, cpus=Decimal("0.1"),
            memory_mb=64, time_limit_s=600, state="running", started_at=now, node=gpus[i].node)
        for i in range(RUNNING)])
    Allocation.objects.bulk_create([Allocation(job=job, attempt=1, gpu=gpus[i], started_at=now)
                                    for i, job in enumerate(running)])
    return project, user




def drain_node_queues() -> int:
    """Empty the nodes' queues on the broker (no agent consumes them); returns the messages dropped."""
    from portal.celery import app, node_queue

    dropped = 0
    with app.connection_for_write() as conn:
        for i in range(NODES):
            try:
                dropped += conn.default_channel.queue_purge(node_queue(f"s{i:02d}")) or 0
            except Exception:  # a queue never declared
                pass
    return dropped


def round_trip(project, user) -> None:
    """Two jobs in, the two oldest running ones out (as the agent reports their ends)."""
    from portal.jobs.models import Allocation, Job

    now = timezone.now()
    Job.objects.bulk_create([Job(project=project, user=user, name="vs", image="x", command=["true"], gpus=1,
                                 cpus=Decimal("0.1"), memory_mb=64, time_limit_s=600, reason_code="new")
                             for _ in range(2)])
    ending = list(Job.objects.filter(state__in=["assigned", "starting", "running"]).order_by("pk").values_list("pk", flat=True)[:2])
    Job.objects.filter(pk__in=ending).update(state="succeeded", ended_at=now, state_changed_at=now)
    Allocation.objects.filter(job_id__in=ending, released_at__isnull=True).update(released_at=now)


def main():
    import statistics

    from scheduler.adapter import run_pass

    rounds = int(os.environ.get("ROUNDS", 200))
    with throwaway_database(os.environ.get("BENCH_DB", "gpuportal_bench_small")) as name:
        project, user = fill()
        run_pass()  # starts nothing (all running), warms the process up
        results, cpu, backend = [], 0.0, 0.0
        profile = None
        if os.environ.get("PROFILE"):
            import cProfile

            profile = cProfile.Profile(time.process_time)
        for _ in range(rounds):
            round_trip(project, user)
            backend0, cpu0 = backend_cpu_s(), time.process_time()
            results.append(profile.runcall(run_pass) if profile else run_pass())
            cpu += time.process_time() - cpu0
            backend1 = backend_cpu_s()
            backend += (backend1 - backend0) if backend1 is not None else 0.0
        if profile:
            import pstats

            pstats.Stats(profile).sort_stats(os.environ["PROFILE"]).print_stats(40)
        dropped = drain_node_queues()
        started = sum(r["started"] for r in results)
        print(f"{rounds} passes on {NODES} nodes x {GPUS_PER_NODE} GPUs ({name}), {started} started: "
              f"CPU per pass {cpu * 1000 / rounds:.2f} ms here, {backend * 1000 / rounds:.2f} ms PostgreSQL "
              f"backend; wall median {statistics.median(r['total_s'] for r in results) * 1000:.1f} ms "
              f"(build {statistics.median(r['build_s'] for r in results) * 1000:.1f}, "
              f"apply {statistics.median(r['apply_s'] for r in results) * 1000:.1f}, "
              f"publish {statistics.median(r['publish_s'] for r in results) * 1000:.1f}); "
              f"{dropped} messages dropped; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
