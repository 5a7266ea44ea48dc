"""The statements every agent report makes, compiled once per process (portal/core/prepared.py) or
written by hand, do what the ORM's did: the node a token names (every agent request), the job a
report names (all the jobs of a batch at once), and a log chunk's INSERT."""
import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from portal.core.context import Actor
from portal.jobs import reports
from portal.jobs.models import Job, JobLogChunk
from portal.jobs.reports import _read
from portal.jobs.services import job_submit
from portal.nodes import services
from portal.nodes.models import Node
from portal.nodes.services import node_add, node_authenticate, node_rotate_token
from scheduler.adapter import run_pass


def columns(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in type(obj)._meta.concrete_fields}


@pytest.fixture
def placed(demo, sent):
    """A 1-GPU job assigned to node gpu-01, with JSON fields that are not empty; (node, secret, job)."""
    node, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    Node.objects.filter(pk=node.pk).update(labels={"rack": "a1"}, cached_datasets=["ab" * 32])
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "j", "image": "gpuportal/busybox:latest", "command": ["sleep", "1"],
        "env": {"A": "1"}, "resources": {"gpus": 1}})
    run_pass()
    Job.objects.filter(pk=job.pk).update(avoid_nodes={"gpu-09": 1.5})
    return node, secret, job


def test_a_token_reads_the_node_the_orm_reads(placed):
    node, secret, _ = placed
    found = node_authenticate(secret)
    assert columns(found) == columns(Node.objects.get(pk=node.pk))
    assert found.labels == {"rack": "a1"} and found.cached_datasets == ["ab" * 32]  # JSON decoded
    assert not found._state.adding and found._state.db == "default"
    found.save(update_fields=["labels"])  # an instance the ORM can write back
    assert services._NODE_BY_DIGEST._local.compiled is not None  # its placeholder was found: compiled


def test_a_rotated_or_unknown_token_is_refused_at_once(demo, placed):
    node, secret, _ = placed
    assert node_authenticate("gpn_" + "x" * 40) is None
    assert node_authenticate(secret) is not None
    node_rotate_token(actor=Actor(user=demo.users["admin"]), node=node)
    assert node_authenticate(secret) is None


def test_a_report_reads_the_job_the_orm_reads(placed):
    node, _, job = placed
    read = _read(job.pk)
    expected = Job.objects.annotate(node_name=F("node__name")).get(pk=job.pk)
    assert expected.state == "assigned"
    assert columns(read) == columns(expected)
    assert read.avoid_nodes == {"gpu-09": 1.5} and read.env == {"A": "1"}
    assert (read.node_name, read.held_on) == ("gpu-01", ["gpu-01"])
    assert _read(job.pk + 10_000) is None
    assert reports._READ._local.compiled is not None


@pytest.fixture
def three_starting(demo, sent):
    """Node gpu-01 and three 1-GPU jobs it confirmed (starting): (node, jobs)."""
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="4xH100-80GB")
    jobs = [job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": f"j{i}", "image": "gpuportal/busybox:latest", "command": ["true"],
        "resources": {"gpus": 1}})[0] for i in range(3)]
    run_pass()
    for job in jobs:
        reports.job_confirm(node=node, job_id=str(job.pk), attempt=1)
    return node, jobs


def end(job, state="succeeded", **more):
    return {"job_id": str(job.pk), "attempt": 1, "state": state, "exit_code": 0, "message": "",
            "scrub_failures": [], "node_problem": "", "lease_expired": False, "not_startable": "", **more}


def job_reads(queries) -> int:
    table = Job._meta.db_table
    return sum(q["sql"].startswith("SELECT") and f'FROM "{table}"' in q["sql"] for q in queries)


def test_a_batch_reads_its_jobs_in_one_statement(three_starting):
    node, jobs = three_starting
    with CaptureQueriesContext(connection) as queries:
        results = reports.job_report_many(node=node, events=[end(job) for job in reversed(jobs)])
    assert [r["result"] for r in results] == ["applied"] * 3
    assert job_reads(queries) == 1
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {"succeeded"}


def test_a_job_twice_in_a_batch_is_read_again_for_its_second_report(three_starting):
    node, (job, other, _) = three_starting
    running = end(job, "running", exit_code=None)
    results = reports.job_report_many(node=node, events=[running, end(other), running])
    # The second `running` sees the first one's effect: a duplicate, not applied again.
    assert [r["result"] for r in results] == ["applied", "applied", "duplicate"]
    assert Job.objects.get(pk=job.pk).state == "running"


def test_a_batch_with_a_node_problem_reads_each_job_in_its_turn(three_starting):
    # The drain a node problem causes moves the node's checkpointing jobs to their next attempt:
    # a later report in the batch for such a job is stale, as it would be alone.
    node, (broken, checkpointing, _) = three_starting
    Job.objects.filter(pk=checkpointing.pk).update(checkpoint_signal="SIGUSR1")
    events = [end(broken, "failed", node_problem="sandbox could not be killed"),
              end(checkpointing, "running", exit_code=None)]
    results = reports.job_report_many(node=node, events=events)
    assert [r["result"] for r in results] == ["applied", "stale"]
    assert Job.objects.get(pk=checkpointing.pk).attempt == 2


@pytest.mark.django_db(transaction=True)  # outside a transaction, as a request stores a chunk: one INSERT
def test_a_log_chunk_is_stored_as_sent_and_a_racing_copy_is_not_stored_twice(three_starting, monkeypatch):
    node, (job, _, _) = three_starting
    assert not connection.in_atomic_block
    chunk = b"nul\x00 bad\xff\n"
    assert reports.job_append_log(node=node, job_id=str(job.pk), attempt=1, offset=0, data=chunk) == {
        "stored": True, "size": len(chunk), "full": False}
    row = JobLogChunk.objects.get(job=job, attempt=1)
    assert (row.offset, bytes(row.data), row.marker) == (0, chunk, False)
    # Another request stored the same chunk between this one's read of the log's end and its INSERT.
    ends = iter([(0, False)])
    monkeypatch.setattr(reports, "log_end", lambda job, attempt: next(ends, (len(chunk), False)))
    assert reports.job_append_log(node=node, job_id=str(job.pk), attempt=1, offset=0, data=chunk) == {
        "stored": False, "size": len(chunk), "full": False}
    assert JobLogChunk.objects.filter(job=job).count() == 1
