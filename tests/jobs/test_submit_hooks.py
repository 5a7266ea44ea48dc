"""The apps above jobs add their part to every submit through portal/jobs/submit_hooks.py (jobs
imports neither): storage checks a spec's volumes and datasets, interactive makes a new job's
ports its sessions. A registration dropped from an AppConfig.ready fails here."""
from portal.interactive.models import Session
from portal.interactive.services import job_sessions_create
from portal.jobs import submit_hooks
from portal.jobs.models import Job
from portal.storage.job_spec import job_spec_errors

IMAGE = "gpuportal/busybox:latest"


def test_storage_and_interactive_register_with_jobs():
    assert submit_hooks.spec_checks == {"storage": job_spec_errors}
    assert submit_hooks.on_create == {"interactive": job_sessions_create}


def test_a_submit_runs_the_registered_checks_and_hooks(demo, api):
    alice = api("alice")
    base = {"project": "vision", "name": "lab", "image": IMAGE, "command": ["sleep", "60"]}
    refused = alice.post("/api/v1/jobs/", data={**base, "volumes": [{"name": "nowhere"}]}, format="json")
    assert refused.status_code == 400, refused.content
    assert "no volume named 'nowhere'" in str(refused.json()), refused.content
    assert not Job.objects.filter(name="lab").exists()
    r = alice.post("/api/v1/jobs/", data={**base, "ports": [{"name": "sh", "kind": "terminal"}]}, format="json")
    assert r.status_code == 201, r.content
    assert list(Session.objects.filter(job_id=r.json()["id"]).values_list("name", "kind")) == [("sh", "terminal")]
