"""A pass that finds nothing changed since the last full one reuses that plan (scheduler/adapter.py,
inputs_digest): it runs no core and writes nothing. Any change to what the snapshot reads, a time
the plan depends on, or a reason note to give makes the next pass a full one again."""
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.test import override_settings
from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import Job, JobState
from portal.jobs.services import job_update
from portal.nodes.models import GPU, GPUHealth
from portal.nodes.services import node_add
from portal.tenancy.models import Quota
from scheduler import adapter
from scheduler.adapter import run_pass
from tests.conftest import submit as submit_job

pytestmark = pytest.mark.django_db(transaction=True)  # the plan is kept once its pass commits


def submit(demo, n, user="alice", **resources):
    return [submit_job(demo, user, name=f"j{i}", resources={"gpus": 1, **resources}) for i in range(n)]


def rows():
    return list(Job.objects.order_by("pk").values_list("pk", "state", "reason_code", "reason_message",
                                                       "queue_position"))


@pytest.fixture
def steady(demo, quiet, monkeypatch):
    """Two GPUs busy, three jobs waiting, and the passes after the starts done: the next pass is steady."""
    cache.delete(adapter.LAST_PLAN)
    monkeypatch.setattr(adapter, "REASON_NOTES", [])
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    jobs = submit(demo, 5)
    assert run_pass()["started"] == 2
    assert "unchanged" not in run_pass()  # the starts changed what it reads
    yield jobs
    cache.delete(adapter.LAST_PLAN)


def core_runs(monkeypatch) -> list:
    calls = []
    real = adapter.core.schedule
    monkeypatch.setattr(adapter.core, "schedule", lambda snapshot: calls.append(1) or real(snapshot))
    return calls


def test_nothing_changed_reuses_the_plan_without_the_core_and_writes_nothing(steady, monkeypatch):
    before = rows()
    planned = core_runs(monkeypatch)
    for _ in range(3):
        result = run_pass()
        assert result["unchanged"] is True
        assert (result["started"], result["waiting"], result["queued"], result["reasons_written"]) == (0, 3, 3, 0)
    assert planned == [] and rows() == before
    assert [r[2] for r in before if r[1] == JobState.QUEUED] != ["", "", ""]  # the reasons stay in place


@pytest.mark.parametrize("change", ["submit", "update", "quota", "gpu_health", "node", "policy"])
def test_any_change_to_what_the_pass_reads_makes_it_plan_again(steady, demo, monkeypatch, change):
    waiting = [j for j in steady if Job.objects.get(pk=j.pk).state == JobState.QUEUED]
    assert run_pass()["unchanged"] is True
    planned = core_runs(monkeypatch)
    expect = {"waiting": 3}
    if change == "submit":
        submit(demo, 1)
        expect = {"waiting": 4}
    elif change == "update":
        job_update(actor=Actor(user=demo.users["alice"]), job=waiting[-1], priority="low")
    elif change == "quota":
        Quota.objects.filter(project__slug="vision").update(max_running_jobs=1)
    elif change == "gpu_health":
        GPU.objects.filter(node__name="gpu-01", index=0).update(health=GPUHealth.UNHEALTHY)
    elif change == "node":
        node_add(actor=Actor(user=demo.users["admin"]), name="gpu-02", gpus="2xH100-80GB")
        expect = {"started": 2, "waiting": 1}
    with override_settings(**({"SCHEDULER_POLICY": "fifo"} if change == "policy" else {})):
        result = run_pass()
    assert "unchanged" not in result and planned == [1]
    assert {k: result[k] for k in expect} == expect
    if change == "quota":  # the new limit is in the reasons
        assert Job.objects.get(pk=waiting[0].pk).reason_message.startswith("Project vision runs 2/1 jobs")


def test_a_waiting_job_whose_time_comes_is_planned_for(steady, monkeypatch):
    """resume_after (a checkpoint still saving) is read against the pass's clock: the pass after it
    is full even though no row changed."""
    job = steady[-1]
    Job.objects.filter(pk=job.pk).update(resume_after=timezone.now() + timedelta(seconds=60))
    assert run_pass()["waiting"] == 2  # a change: full, without the job
    assert run_pass()["unchanged"] is True
    later = timezone.now() + timedelta(seconds=61)
    monkeypatch.setattr(adapter.timezone, "now", lambda: later)
    with override_settings(SCHEDULER_REPLAN_S=3600):
        result = run_pass()
    assert "unchanged" not in result and result["waiting"] == 3


def test_time_alone_replans_after_scheduler_replan_s(steady, monkeypatch):
    with override_settings(SCHEDULER_REPLAN_S=3600):
        run_pass()
        assert run_pass()["unchanged"] is True
        later = timezone.now() + timedelta(seconds=3601)
        monkeypatch.setattr(adapter.timezone, "now", lambda: later)
        assert "unchanged" not in run_pass()
    with override_settings(SCHEDULER_REPLAN_S=0):  # 0: every pass plans
        assert "unchanged" not in run_pass()
        assert "unchanged" not in run_pass()


def test_a_reason_note_to_give_makes_every_pass_plan(steady, monkeypatch):
    notes = {"quiet": False}

    def source(job_ids):
        return {} if notes["quiet"] else {str(job_ids[0]): "scaling up pool p: node p-1 booting (5 s)"}

    source.quiet = lambda: notes["quiet"]
    monkeypatch.setattr(adapter, "REASON_NOTES", [source])
    run_pass()
    assert "unchanged" not in run_pass()  # the last plan gave a note: it may read differently now
    assert Job.objects.filter(reason_message__startswith="scaling up pool p").count() == 1
    notes["quiet"] = True
    run_pass()
    assert run_pass()["unchanged"] is True
    notes["quiet"] = False  # a note appears (a node boots for them): the next pass gives it
    assert "unchanged" not in run_pass()
    monkeypatch.setattr(adapter, "REASON_NOTES", [lambda job_ids: {}])  # a source that cannot say
    run_pass()
    assert "unchanged" not in run_pass()


def test_a_pass_that_starts_jobs_keeps_no_plan(steady, demo):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-02", gpus="8xH100-80GB")
    assert run_pass()["started"] == 3
    assert cache.get(adapter.LAST_PLAN) is None
    assert "unchanged" not in run_pass()
