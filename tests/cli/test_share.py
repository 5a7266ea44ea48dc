"""gpuctl share: who may connect to a job's session besides its owner (docs/sessions.md)."""
import json

from django.contrib.auth import get_user_model

from portal.interactive.models import Session
from portal.interactive.selectors import session_for_connect
from portal.tenancy.models import Membership
from tests.conftest import submit


def test_the_owner_shares_a_session_with_the_project_and_people_by_name(portal, gpuctl, monkeypatch):
    job = submit(portal, ports=[{"name": "lab", "kind": "jupyter"}, {"name": "sh", "kind": "terminal"}])
    erin = get_user_model().objects.create_user("erin", password="x-erin-pass-123")
    Membership.objects.create(project=portal.vision, user=erin, role="viewer")
    result = gpuctl("share", job.pk, "lab")
    assert result.exit_code == 0 and result.stdout.strip() == f"Session lab of job {job.pk}: its owner."
    result = gpuctl("share", job.pk, "lab", "--user", "erin", "-u", "dave", "-o", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["users"] == ["dave", "erin"]
    assert session_for_connect(erin, job.pk, "lab") is not None and session_for_connect(erin, job.pk, "sh") is None
    result = gpuctl("share", job.pk, "lab", "--project", "--no-users")
    assert result.exit_code == 0 and result.stdout.strip() == f"Session lab of job {job.pk}: the job's project."
    assert Session.objects.get(job=job, name="lab").share == "project"
    assert not Session.objects.get(job=job, name="lab").shared_users.exists()
    # Another tenant's user is refused like an unknown name; a session the job does not publish is said so.
    result = gpuctl("share", job.pk, "lab", "--user", "charlie")
    assert result.exit_code == 2 and "No user named 'charlie' in this job's organization" in result.stderr
    result = gpuctl("share", job.pk, "web", "--project")
    assert result.exit_code == 1 and f"job {job.pk} publishes no session 'web'; its sessions: lab, sh." in result.stderr
    # Only the owner shares; another tenant does not see the job at all.
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["bob"])
    result = gpuctl("share", job.pk, "lab", "--owner")
    assert result.exit_code == 3 and "Only the job's owner can share its sessions" in result.stderr
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["charlie"])
    result = gpuctl("share", job.pk, "lab", "--owner")
    assert result.exit_code == 1 and "its sessions: none" in result.stderr  # as for a job that does not exist
    assert Session.objects.get(job=job, name="lab").share == "project"
