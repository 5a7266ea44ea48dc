"""The autoscaler end to end with the `local` provider: a real Celery worker with beat (scheduling
passes and autoscaler ticks), the broker of CELERY_BROKER_URL, the portal (live server on
PostgreSQL), and real agent processes (`python -m agents`, simulated GPUs, process sandbox) that the
autoscaler starts and stops.

64 one-GPU jobs on an empty pool of 8-GPU nodes scale it to 8 nodes in one step; the jobs run and
end; the nodes are released after the pool's idle time, and no agent is left running.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from portal.autoscale import localnode
from portal.autoscale.models import NodePool, PoolNode, ScaleEvent
from portal.autoscale.selectors import pool_summaries
from portal.autoscale.services import release_all
from portal.core.context import Actor
from portal.jobs.models import Allocation, Job
from portal.jobs.services import job_submit
from portal.nodes.models import Node
from portal.tenancy.models import Quota
from tests.procs import start_process, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.django_db(transaction=True)


def _db_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


@pytest.fixture
def stack(live_server, tmp_path, demo, settings):
    assert connection.vendor == "postgresql", "the stack needs PostgreSQL (DATABASE_URL)"
    assert not settings.CELERY_BROKER_URL.startswith("filesystem"), "the stack needs a broker server (Redis)"
    settings.NODE_HEARTBEAT_INTERVAL_S = 1.0
    settings.TEST_NODES_SKIP_QUEUE_PROBE = False  # every node proves it reads its queue, as in production
    nodes_root = tmp_path / "nodes"
    settings.AUTOSCALE_LOCAL_ROOT = nodes_root
    env = {**os.environ, "DATABASE_URL": _db_url(), "CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "DEBUG": "1",
           "AUTOSCALE_INTERVAL_S": "1", "AUTOSCALE_LOCAL_ROOT": str(nodes_root),
           "GPUPORTAL_TEST_NODES_SKIP_QUEUE_PROBE": "0", "NODE_HEARTBEAT_INTERVAL_S": "1"}
    log = open(tmp_path / "worker.log", "a+")
    worker = start_process([sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "scheduler,default", "-B",
                            "--schedule", str(tmp_path / "beat-schedule"), "-P", "solo", "-n", f"as-{tmp_path.name}@%h",
                            "--loglevel", "INFO"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    pool = None
    try:
        wait_for(lambda: "ready." in (tmp_path / "worker.log").read_text() or worker.poll() is not None, 60,
                 "the worker")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        pool = NodePool.objects.create(
            name="h100", provider="local", enabled=False, gpu_model="H100-80GB", gpus_per_node=8, sandbox="process",
            price_per_gpu_hour="2.00", max_nodes=8, max_per_step=8, idle_release_s=4, boot_timeout_s=180,
            max_concurrent_releases=8, provider_config={"portal_url": live_server.url})
        yield type("Stack", (), {"pool": pool, "root": nodes_root, "log": tmp_path / "worker.log"})
    finally:
        stop_process(worker)
        log.close()
        if pool is not None:
            release_all(pool)
        for name in localnode.running(nodes_root):  # whatever a failed test left
            localnode.stop(name, root=nodes_root)


@pytest.mark.timeout(600)  # 8 agents starting at once on a shared 2-core machine
def test_64_one_gpu_jobs_scale_an_empty_pool_to_8_nodes_then_release_them(stack, demo):
    # Room for all 64 at once in the project's quota (the demo's allows 16 GPUs: 2 nodes' worth).
    Quota.objects.filter(project=demo.vision).update(max_gpus=64, max_running_jobs=64)
    actor = Actor(user=demo.users["alice"])
    jobs = [job_submit(actor=actor, data={
        "project": "vision", "name": f"burst-{i}", "image": "gpuportal/busybox:latest", "command": ["sh", "-c", "sleep 2"],
        "resources": {"gpus": 1, "cpus": 0.1, "memory_mb": 64}, "time_limit": 300})[0] for i in range(64)]
    NodePool.objects.filter(pk=stack.pool.pk).update(enabled=True)

    def log_tail():
        return stack.log.read_text()[-3000:]

    # One step of 8 nodes, each started for 8 of the jobs, which say so while it boots.
    wait_for(lambda: PoolNode.objects.filter(pool=stack.pool).count() == 8, 60, f"8 nodes; worker:\n{log_tail()}")
    up = ScaleEvent.objects.get(kind="scale_up")
    assert up.delta == 8 and up.nodes == [f"h100-{i}" for i in range(1, 9)] and float(up.demand_gpus) == 64
    assert "64 waiting jobs (64 GPUs) need 8 more node(s) of 8xH100-80GB" in up.reason
    assert sorted(len(p.jobs) for p in PoolNode.objects.filter(pool=stack.pool)) in ([8] * 8, [0] * 8)
    # Every job runs and succeeds on a pool node.
    wait_for(lambda: Job.objects.filter(pk__in=[j.pk for j in jobs], state="succeeded").count() == 64, 300,
             f"64 jobs to succeed: {list(Job.objects.values_list('state', 'reason_message')[:3])}\n{log_tail()}")
    assert set(Allocation.objects.values_list("gpu__node__pool", flat=True)) == {"h100"}
    # All 8 register (the jobs, 2 s each, may all have run on the first ones up, before the last booted).
    wait_for(lambda: ScaleEvent.objects.filter(kind="registered").count() == 8, 180,
             f"8 registrations: {list(PoolNode.objects.values_list('name', 'state'))}\n{log_tail()}")
    assert PoolNode.objects.filter(pool=stack.pool).count() == 8  # never more than the pool's maximum
    # The idle nodes are released after the idle time: drained, deleted, their agents gone.
    wait_for(lambda: PoolNode.objects.filter(pool=stack.pool, state="released").count() == 8, 120,
             f"8 releases: {list(PoolNode.objects.values_list('name', 'state'))}\n{log_tail()}")
    assert localnode.running(stack.root) == {}
    assert set(Node.objects.filter(pool="h100").values_list("state", "token_digest")) == {("down", "")}
    released = ScaleEvent.objects.filter(kind="released")
    assert released.count() == 8 and all("idle for" in e.reason for e in released)
    # The books: every node was paid from its creation to its release, and the jobs used part of it.
    summary, = pool_summaries()
    assert summary["live"] == 0 and summary["gpu_hours_paid"] > summary["gpu_hours_used"] > 0
    assert summary["gpu_hours_used"] >= 64 * 2 / 3600
