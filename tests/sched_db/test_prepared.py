"""Reads compiled once (portal/core/prepared.py) return what the ORM returns for the same queryset,
with each call's placeholder values in place, and fall back to the ORM where the backend converts
a placeholder. Those of a pass and of its launches that take a list (AnyOf) read what the ORM's
`__in` read."""
import threading
from datetime import timedelta

import pytest
from django.db import connections
from django.db.models import DateTimeField, F
from django.utils import timezone

from portal.core.context import Actor
from portal.core.prepared import AnyOf, Prepared
from portal.jobs import selectors
from portal.jobs.models import HOLDING, Allocation, Job, JobState, ProjectFairshare, ProjectMonthUsage
from portal.jobs.states import transition
from portal.jobs.usage import usage_fold
from portal.nodes.models import Node
from portal.nodes.services import node_add
from portal.tenancy.models import Organization, Quota
from scheduler import adapter
from tests.conftest import submit

EPOCH = adapter._NOW


def queued_after(since):
    return Job.objects.filter(state=JobState.QUEUED, submitted_at__gte=since).order_by("pk")


@pytest.mark.django_db
def test_rows_equal_the_orms_for_each_shape_and_placeholder_value(demo):
    jobs = [submit(demo, "alice", name=f"j{i}", resources={"gpus": 1}) for i in range(3)]
    Job.objects.filter(pk=jobs[0].pk).update(submitted_at=timezone.now() - timedelta(hours=2))
    shapes = {
        "values": lambda since: queued_after(since).values("id", "name", "env", **adapter.JOB_TIMES),
        "values_list": lambda since: queued_after(since).values_list("id", "cpus", adapter.Epoch("submitted_at")),
        "flat": lambda since: queued_after(since).values_list("id", flat=True),
    }
    for shape, build in shapes.items():
        prepared = Prepared(build, since=EPOCH)
        for since in (timezone.now() - timedelta(days=1), timezone.now() - timedelta(hours=1), timezone.now()):
            assert prepared.rows(since=since) == list(build(since)), (shape, since)
        assert prepared._local.compiled is not None, shape  # compiled once, then only run


@pytest.mark.django_db
def test_a_placeholder_the_backend_converts_is_read_through_the_orm(demo):
    job = submit(demo, "alice", name="named", resources={"gpus": 1})
    # A CharField turns the placeholder into its text: it cannot be found among the parameters.
    prepared = Prepared(lambda name: Job.objects.filter(name=name).values_list("pk", flat=True), name=123)
    assert prepared.rows(name="named") == [job.pk]
    assert prepared._local.compiled is None


@pytest.mark.django_db(transaction=True)
def test_each_thread_compiles_and_runs_on_its_own_connection(demo):
    job = submit(demo, "alice", name="threaded", resources={"gpus": 1})
    prepared = Prepared(lambda: Job.objects.filter(name="threaded").values_list("pk", flat=True))
    assert prepared.rows() == [job.pk]
    seen = []

    def read():
        try:
            seen.append((prepared.rows(), prepared._local.compiled[3].connection is connections["default"]))
        finally:
            connections.close_all()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert seen == [([job.pk], True)]


@pytest.mark.django_db
def test_any_of_a_list_placeholder_reads_what_in_reads_for_any_length(demo):
    jobs = [submit(demo, "alice", name=f"j{i}", resources={"gpus": 1}) for i in range(3)]
    prepared = Prepared(lambda ids: Job.objects.filter(AnyOf(F("pk"), ids)).order_by("pk").values_list("pk", "name"),
                        ids=[])
    for ids in ([], [jobs[1].pk], [j.pk for j in jobs], [jobs[0].pk, jobs[2].pk, 10**9]):
        assert prepared.rows(ids=ids) == list(Job.objects.filter(pk__in=ids).order_by("pk").values_list("pk", "name"))
    assert prepared._local.compiled is not None  # one statement for every length


@pytest.fixture
def running_and_folded(demo, quiet):
    """Jobs of two projects holding GPUs, one ended and folded into the usage totals: rows for
    every read of a pass and of its launches."""
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="4xH100-80GB")
    jobs = [submit(demo, user, project=project, name=f"{project}{i}", resources={"gpus": 1})
            for i, (user, project) in enumerate([("alice", "vision"), ("alice", "vision"), ("charlie", "nlp")])]
    assert adapter.run_pass()["started"] == 3
    transition(jobs[0].pk, to=JobState.SUCCEEDED, from_states=HOLDING)  # releases its GPU
    usage_fold()
    # An earlier attempt of a running job, released (what the las policy counts).
    now, gpu = timezone.now(), Allocation.objects.filter(job=jobs[1]).values_list("gpu_id", flat=True).get()
    Allocation.objects.create(job=jobs[1], attempt=1, gpu_id=gpu, started_at=now - timedelta(hours=1),
                              released_at=now - timedelta(minutes=30))
    Job.objects.filter(pk=jobs[1].pk).update(attempt=2)
    Allocation.objects.filter(job=jobs[1], released_at__isnull=True).update(attempt=2)
    return jobs


def same_rows(prepared_rows, orm_rows):
    key = repr
    return sorted(prepared_rows, key=key) == sorted(orm_rows, key=key)


@pytest.mark.django_db
def test_the_compiled_reads_of_a_pass_and_its_launches_equal_the_orms(demo, running_and_folded):
    job_ids = [j.pk for j in running_and_folded] + [10**9]
    project_ids = [demo.vision.pk, demo.nlp.pk]
    slugs = ["vision", "nlp", "missing"]
    launch_columns = [f.attname for f in Job._meta.concrete_fields
                      if not isinstance(f, DateTimeField) and f.name != "avoid_nodes"]
    pairs = [
        (selectors._LAUNCH_JOBS.rows(ids=job_ids), Job.objects.filter(pk__in=job_ids, state__in=HOLDING).values(
            *launch_columns, node_name=F("node__name"), project_slug=F("project__slug"),
            org_slug=F("project__organization__slug"), network_allowed=F("project__quota__network_allowed"))),
        (selectors._LAUNCH_ALLOCATIONS.rows(ids=job_ids),
         Allocation.objects.filter(job_id__in=job_ids, released_at__isnull=True)
         .order_by("gpu__node__name", "gpu__index")
         .values_list("job_id", "gpu__node__name", "gpu__index", "gpu__uuid", "fraction", "shared")),
        (adapter._SNAPSHOT_QUOTAS.rows(slugs=slugs), [
            (q.project.slug, q.project_id, q.project.organization.slug, q.guaranteed_gpus, q.max_gpus,
             q.max_running_jobs, q.max_time_limit_s, q.gpu_hours_budget, q.budget_hard_stop, q.allowed_gpu_types)
            for q in Quota.objects.filter(project__slug__in=slugs).select_related("project__organization")]),
        (adapter._SNAPSHOT_ORGS.rows(slugs=slugs),
         [(o.slug, o.max_gpus) for o in Organization.objects.filter(projects__slug__in=slugs).distinct()]),
        (adapter._EARLIER_ATTEMPTS.rows(), Allocation.objects.filter(
            released_at__isnull=False, attempt__lt=F("job__attempt"),
            job__state__in=[JobState.QUEUED, *HOLDING]).values_list("job_id", "started_at", "released_at", "fraction")),
        (adapter._GANG_NODES.rows(ids=job_ids), Allocation.objects.filter(
            job_id__in=job_ids, released_at__isnull=True).values_list("job_id", "gpu__node__name")),
        (adapter._PROTOCOLS.rows(names=["gpu-01", "missing"]),
         Node.objects.filter(name__in=["gpu-01", "missing"]).values_list("name", "protocol_version")),
    ]
    for i, (compiled, orm) in enumerate(pairs):
        orm = list(orm)
        assert orm, i  # the fixture gives each read rows to compare
        assert same_rows(compiled, orm), i
    # The launch allocations keep their order (a gang's first node is its rendezvous master).
    assert pairs[1][0] == list(pairs[1][1])
    # No rows for no ids, as `__in` of an empty list.
    assert selectors._LAUNCH_JOBS.rows(ids=[]) == [] and adapter._SNAPSHOT_QUOTAS.rows(slugs=[]) == []


@pytest.mark.django_db
def test_a_passes_usage_figures_are_summed_by_one_compiled_statement_as_python_sums_the_rows(
        demo, running_and_folded):
    now, half_life = timezone.now(), 7 * 86400.0
    project_ids = [demo.vision.pk, demo.nlp.pk]
    assert ProjectMonthUsage.objects.exists() and ProjectFairshare.objects.exists()
    for at in (now, now + timedelta(hours=5)):
        hours, usage = selectors.usage_for_pass(project_ids, half_life_s=half_life, now=at)
        rows = list(selectors.untallied_allocations(project_ids))
        expected_hours = selectors._month_hours(project_ids, at, rows)
        expected_usage = selectors._decayed(project_ids, half_life, at, rows)
        assert hours.keys() == expected_hours.keys() == set(project_ids)
        assert usage.keys() == expected_usage.keys() == set(project_ids)
        assert all(hours[p] == pytest.approx(expected_hours[p], rel=1e-12) for p in project_ids)
        assert all(usage[p] == pytest.approx(expected_usage[p], rel=1e-12) for p in project_ids)
    assert selectors._PASS_USAGE._local.compiled is not None
