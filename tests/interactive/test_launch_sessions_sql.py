"""launch_sessions, read by every pass that starts jobs, is compiled once per process (a Prepared
read with one array parameter): whatever the ids, it gives the ORM's rows."""
import pytest
from django.db import connection

from portal.core.context import Actor
from portal.interactive.models import Session
from portal.interactive.selectors import _LAUNCH_SESSIONS, launch_sessions
from portal.jobs.services import job_submit


def orm_rows(ids):
    return list(Session.objects.filter(job_id__in=ids).order_by("job_id", "name").values_list(
        "job_id", "name", "port", "kind", "secret", "job__attempt", "legacy_key", "legacy_attempt"))


@pytest.mark.django_db
def test_the_compiled_read_gives_the_orms_rows(demo):
    jobs = []
    for ports in ([{"name": "web", "kind": "http", "port": 8000}, {"name": "api", "kind": "http", "port": 9000}],
                  [{"name": "lab", "kind": "http", "port": 8888}], []):
        job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
            "project": "vision", "image": "gpuportal/busybox:latest", "command": ["sleep", "1d"], "ports": ports})
        jobs.append(job.pk)
    for ids in ([jobs[0]], jobs, [jobs[2]], [jobs[1], jobs[0], 999999], jobs):
        assert _LAUNCH_SESSIONS.rows(ids=ids) == orm_rows(ids), ids
    assert [s["name"] for s in launch_sessions(jobs)[jobs[0]]] == ["api", "web"] and jobs[2] not in launch_sessions(jobs)
    assert launch_sessions([]) == {}
    if connection.vendor == "postgresql":
        assert _LAUNCH_SESSIONS._local.compiled is not None  # compiled, not built each time
