"""``plainsql.insert`` writes the row ``Model.objects.create`` would: every column, converted alike
(JSON, times, defaults, auto_now_add), and the instance ends up saved with its id."""
import pytest

from portal.core.context import Actor
from portal.core.models import AuditEvent
from portal.core.plainsql import insert
from portal.jobs.models import Job
from portal.jobs.services import job_submit

SKIP = {"id", "at", "submitted_at", "state_changed_at", "created_at"}


def row(model, pk) -> dict:
    return {k: v for k, v in model.objects.filter(pk=pk).values()[0].items() if k not in SKIP}


@pytest.mark.django_db
def test_an_audit_row_inserted_plainly_is_the_orms(demo):
    kwargs = dict(actor=demo.users["alice"], actor_label="alice", action="job.submit", object_type="jobs.job",
                  object_id="7", object_repr="a job", source_ip="10.0.0.1", token_prefix="gpp_x",
                  data={"gpus": "1", "nested": {"a": [1, None, "é"]}})
    orm = AuditEvent.objects.create(**kwargs)
    plain = AuditEvent(**kwargs)
    insert(plain)
    assert plain.pk and plain.pk != orm.pk and not plain._state.adding
    assert row(AuditEvent, plain.pk) == row(AuditEvent, orm.pk)
    assert AuditEvent.objects.get(pk=plain.pk).created_at == plain.created_at  # auto_now_add filled in


@pytest.mark.django_db
def test_a_submitted_job_row_is_the_orms(demo):
    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "train", "image": "gpuportal/busybox:latest", "command": ["sh", "-c", "x"],
        "env": {"A": "1"}, "resources": {"gpus": 1, "cpus": 2, "memory_mb": 512}})
    fields = {f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields if f.attname != "id"}
    orm = Job.objects.create(**fields)
    assert row(Job, job.pk) == row(Job, orm.pk)
    assert Job.objects.get(pk=job.pk).submitted_at == job.submitted_at
