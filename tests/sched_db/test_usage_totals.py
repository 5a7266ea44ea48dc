"""Running usage totals (portal/jobs/usage.py): budgets and fair share read them instead of every
allocation of the month, and they equal that scan whatever the history, however often and by
however many the fold runs."""
import random
import threading
from collections import defaultdict
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connections
from django.test import override_settings
from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import HOLDING, Allocation, Job, JobState, ProjectFairshare, ProjectMonthUsage
from portal.jobs.selectors import decayed_usage, gpu_hours_used_this_month, month_start, usage_for_pass
from portal.jobs.services import job_submit
from portal.jobs.states import transition
from portal.jobs.usage import usage_fold
from portal.nodes.services import node_add
from scheduler import adapter
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"
HALF_LIFE = 7 * 86400


def scan_month_hours(now) -> dict[int, float]:
    """The definition: every allocation's overlap with this month (open ones up to now), in Python."""
    start = month_start(now)
    out: dict[int, float] = defaultdict(float)
    for pid, started, released, fraction in Allocation.objects.values_list(
            "job__project_id", "started_at", "released_at", "fraction"):
        end = released or now
        if end > start:
            out[pid] += max(0.0, (end - max(started, start)).total_seconds()) * float(fraction) / 3600
    return out


def scan_decayed(now, half_life) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for pid, started, released, fraction in Allocation.objects.values_list(
            "job__project_id", "started_at", "released_at", "fraction"):
        end = released or now
        out[pid] += max(0.0, (end - started).total_seconds()) * float(fraction) * 0.5 ** (
            (now - end).total_seconds() / half_life)
    return out


def assert_totals_equal_scan(project_ids, now, half_life=HALF_LIFE):
    hours, expected_hours = gpu_hours_used_this_month(project_ids, now), scan_month_hours(now)
    usage, expected_usage = decayed_usage(project_ids, half_life_s=half_life, now=now), scan_decayed(now, half_life)
    for pid in project_ids:
        assert hours.get(pid, 0.0) == pytest.approx(expected_hours.get(pid, 0.0), rel=1e-9, abs=1e-9), pid
        assert usage.get(pid, 0.0) == pytest.approx(expected_usage.get(pid, 0.0), rel=1e-9, abs=1e-6), pid
    pass_hours, pass_usage = usage_for_pass(project_ids, half_life_s=half_life, now=now)  # what a pass reads
    # Summed in PostgreSQL by the pass (a fair-share total kept under another half-life: in Python).
    assert pass_hours.keys() == hours.keys() and pass_usage.keys() == usage.keys()
    assert all(pass_hours[pid] == pytest.approx(hours[pid], rel=1e-12, abs=1e-9) for pid in hours)
    assert all(pass_usage[pid] == pytest.approx(usage[pid], rel=1e-12, abs=1e-9) for pid in usage)


@pytest.fixture
def history(demo):
    """A node and one job per project to hang random allocations on."""
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    gpus = list(node.gpus.order_by("index"))
    jobs = {p.pk: Job.objects.create(project=p, user=demo.users["alice"], name="h", image=IMAGE, command=["true"],
                                     gpus=1, time_limit_s=3600, state=JobState.SUCCEEDED)
            for p in (demo.vision, demo.nlp)}
    return gpus, jobs


def random_allocation(rng, now, gpus, jobs, *, open_=False) -> Allocation:
    """Up to 80 days back (so across one or two months' ends), minutes to weeks long, whole or a fraction."""
    started = now - timedelta(seconds=rng.uniform(0, 80 * 86400))
    released = None if open_ else min(now, started + timedelta(seconds=rng.choice([60, 3600, 86400, 20 * 86400])
                                                               * rng.random()))
    fraction = rng.choice([Decimal(1), Decimal(1), Decimal("0.5"), Decimal("0.125")])
    return Allocation(job=rng.choice(list(jobs.values())), attempt=1, gpu=rng.choice(gpus), shared=True,
                      fraction=fraction, started_at=started, released_at=released)


@pytest.mark.django_db
@pytest.mark.parametrize("seed", range(4))
def test_totals_equal_the_scan_for_random_histories(history, seed):
    gpus, jobs = history
    rng = random.Random(seed)
    now = timezone.now()
    for _ in range(12):  # batches of history, a fold (or not) between them
        Allocation.objects.bulk_create([random_allocation(rng, now, gpus, jobs, open_=rng.random() < 0.1)
                                        for _ in range(rng.randint(0, 40))])
        if rng.random() < 0.7:
            usage_fold()
        assert_totals_equal_scan(list(jobs), now)
        # Readers are exact at any later instant too (the totals decay, the month may turn).
        assert_totals_equal_scan(list(jobs), now + timedelta(seconds=rng.uniform(0, 40 * 86400)))
    usage_fold()
    assert not Allocation.objects.filter(tallied=False, released_at__isnull=False).exists()
    assert ProjectMonthUsage.objects.exists() and ProjectFairshare.objects.count() == 2
    assert_totals_equal_scan(list(jobs), now)


@pytest.mark.django_db
def test_a_fold_adds_each_allocation_once(history):
    gpus, jobs = history
    rng = random.Random(9)
    now = timezone.now()
    Allocation.objects.bulk_create([random_allocation(rng, now, gpus, jobs) for _ in range(30)])
    assert usage_fold() == 30
    totals = sorted(ProjectMonthUsage.objects.values_list("project_id", "month", "gpu_s"))
    fairshare = sorted(ProjectFairshare.objects.values_list("project_id", "decayed_gpu_s", "as_of"))
    assert usage_fold() == 0  # nothing new: nothing added again
    assert sorted(ProjectMonthUsage.objects.values_list("project_id", "month", "gpu_s")) == totals
    assert sorted(ProjectFairshare.objects.values_list("project_id", "decayed_gpu_s", "as_of")) == fairshare
    assert_totals_equal_scan(list(jobs), now)


@pytest.mark.django_db
def test_an_allocation_across_a_months_end_counts_in_each_month(history):
    gpus, jobs = history
    pid, job = next(iter(jobs.items()))
    this_month = month_start(timezone.now())
    last_month = month_start(this_month - timedelta(days=1))
    Allocation.objects.create(job=job, attempt=1, gpu=gpus[0], started_at=this_month - timedelta(hours=2),
                              released_at=this_month + timedelta(hours=3))
    usage_fold()
    assert dict(ProjectMonthUsage.objects.filter(project_id=pid).values_list("month", "gpu_s")) == {
        last_month.date(): 2 * 3600.0, this_month.date(): 3 * 3600.0}
    assert gpu_hours_used_this_month([pid], this_month + timedelta(hours=4)) == {pid: pytest.approx(3.0)}


@pytest.mark.django_db
def test_a_new_half_life_rebuilds_the_fair_share_once(history):
    gpus, jobs = history
    rng = random.Random(3)
    now = timezone.now()
    Allocation.objects.bulk_create([random_allocation(rng, now, gpus, jobs) for _ in range(30)])
    usage_fold()
    # Asked under another half-life before any fold rebuilt it: still exact, from the allocations.
    assert_totals_equal_scan(list(jobs), now, half_life=86400)
    with override_settings(SCHEDULER_FAIRSHARE_HALF_LIFE_S=86400):
        usage_fold()
        assert set(ProjectFairshare.objects.values_list("half_life_s", flat=True)) == {86400.0}
        assert_totals_equal_scan(list(jobs), now, half_life=86400)


@pytest.mark.django_db
def test_ends_through_the_lifecycle_and_passes_keep_the_totals_exact(demo, quiet, monkeypatch):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    actor = Actor(user=demo.users["alice"])
    for i in range(6):
        job_submit(actor=actor, data={"project": "vision", "name": f"j{i}", "image": IMAGE, "command": ["true"],
                                      "resources": {"gpus": 1}})
    run_pass()
    for job in Job.objects.filter(state__in=HOLDING)[:4]:
        assert transition(job.pk, to=JobState.SUCCEEDED, from_states=HOLDING, attempt=job.attempt)
    assert Allocation.objects.filter(tallied=False, released_at__isnull=False).count() == 4
    monkeypatch.setattr(adapter, "USAGE_FOLD_INTERVAL_S", 3600.0)
    run_pass()  # a fold is not due: the ends wait, and the readers count them from their rows
    assert Allocation.objects.filter(tallied=False, released_at__isnull=False).count() == 4
    assert_totals_equal_scan([demo.vision.pk], timezone.now())
    monkeypatch.setattr(adapter, "USAGE_FOLD_INTERVAL_S", 0.0)
    run_pass()  # folds the four ends
    assert not Allocation.objects.filter(tallied=False, released_at__isnull=False).exists()
    assert_totals_equal_scan([demo.vision.pk], timezone.now())


@pytest.mark.django_db(transaction=True)
def test_concurrent_folds_add_each_allocation_once(history):
    gpus, jobs = history
    rng = random.Random(5)
    now = timezone.now()
    Allocation.objects.bulk_create([random_allocation(rng, now, gpus, jobs) for _ in range(200)])
    folded, errors = [], []
    barrier = threading.Barrier(4)

    def fold():
        try:
            barrier.wait()
            folded.append(usage_fold(batch=50))
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=fold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sum(folded) == 200
    assert_totals_equal_scan(list(jobs), now)
