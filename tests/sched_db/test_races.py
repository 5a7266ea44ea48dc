"""Scheduling passes against the real database: races, crashes, the double-booking guard.

These need PostgreSQL (advisory locks, row locks, concurrent transactions); on another
database they fail with a message saying so rather than pass vacuously.
"""
import os
import subprocess
import sys
import threading
from collections import Counter

import pytest
from django.conf import settings
from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job, JobEvent
from portal.jobs.services import job_cancel, job_submit
from portal.nodes.models import GPU
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"
pytestmark = pytest.mark.django_db(transaction=True)


def _submit(demo, n, gpus, user="alice", project="vision"):
    actor = Actor(user=demo.users[user])
    return [job_submit(actor=actor, data={"project": project, "name": f"j{i}", "image": IMAGE, "command": ["true"],
                                          "resources": {"gpus": gpus}})[0] for i in range(n)]


def _in_threads(*fns):
    errors = []
    barrier = threading.Barrier(len(fns))

    def wrap(fn):
        try:
            barrier.wait()
            fn()
        except Exception as exc:  # surfaced below; a thread's exception would otherwise vanish
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def test_racing_passes_never_double_book(demo, quiet):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    _submit(demo, 12, 1)
    results = []
    _in_threads(*[lambda: results.append(run_pass()) for _ in range(4)])
    open_allocs = Allocation.objects.filter(released_at__isnull=True)
    per_gpu = Counter(open_allocs.values_list("gpu_id", flat=True))
    assert per_gpu and max(per_gpu.values()) == 1
    assert Job.objects.filter(state="assigned").count() == 8 == open_allocs.count()
    # Passes that ran serialized on the lock; together they started exactly the 8 that fit.
    assert sum(r.get("started", 0) for r in results) == 8


def test_database_refuses_a_second_open_allocation_on_a_whole_gpu(demo):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    a, b = _submit(demo, 2, 1)
    gpu = GPU.objects.get()
    Allocation.objects.create(job=a, attempt=1, gpu=gpu, started_at=timezone.now())
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(job=b, attempt=1, gpu=gpu, started_at=timezone.now())



def test_a_bulk_start_the_database_refuses_is_retried_one_by_one(demo, quiet, monkeypatch):
    """A GPU taken between the snapshot and the apply (here: an allocation written right after
    the snapshot) makes the bulk insert fail on the partial unique index: the pass then starts
    the jobs one by one, and only the one placed on that GPU stays queued."""
    from scheduler import adapter

    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    intruder, *jobs = _submit(demo, 3, 1)
    Job.objects.filter(pk=intruder.pk).update(held=True)  # not in the snapshot: it takes a GPU meanwhile
    real = adapter.build_snapshot

    def snapshot_then_take_a_gpu(now=None):
        snap, context = real(now)
        Allocation.objects.create(job=intruder, attempt=1, gpu=GPU.objects.order_by("index").first(),
                                  started_at=timezone.now())
        return snap, context

    monkeypatch.setattr(adapter, "build_snapshot", snapshot_then_take_a_gpu)
    assert run_pass()["started"] == 1
    assert sorted(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) \
        == ["assigned", "queued"]
    assert Allocation.objects.filter(released_at__isnull=True).count() == 2  # the intruder's and one start

@pytest.mark.parametrize("round_", range(4))
def test_cancel_racing_a_start_ends_once(demo, quiet, round_):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    job, = _submit(demo, 1, 2)
    alice = Actor(user=demo.users["alice"])
    _in_threads(run_pass, lambda: job_cancel(actor=alice, job=Job.objects.get(pk=job.pk)))
    job.refresh_from_db()
    assert job.state == "cancelled"
    assert JobEvent.objects.filter(job=job, terminal=True).count() == 1
    assert not Allocation.objects.filter(job=job, released_at__isnull=True).exists()


def _pass_in_subprocess(crashpoint: str):
    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    env = {**os.environ, "DATABASE_URL": url, "GPUPORTAL_CRASHPOINTS": "1", "GPUPORTAL_CRASHPOINT": crashpoint,
           "DEBUG": "1"}
    return subprocess.run([sys.executable, "manage.py", "shell", "-c",
                           "from scheduler.adapter import run_pass; print(run_pass())"],
                          cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("point", ["schedule.after_snapshot", "schedule.before_commit"])
def test_worker_killed_mid_pass_loses_nothing(demo, quiet, point):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="4xH100-80GB")
    jobs = _submit(demo, 3, 1)
    proc = _pass_in_subprocess(point)
    assert proc.returncode == -9, proc.stdout + proc.stderr[-2000:]
    # The killed pass left no trace: everything still queued, no GPU held.
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {"queued"}
    assert not Allocation.objects.exists()
    # The next pass redoes the work.
    assert run_pass()["started"] == 3
    assert Job.objects.filter(state="assigned").count() == 3
