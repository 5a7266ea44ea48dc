"""gpuctl hold, release and update (Slurm's scontrol), and array tasks named 3_0."""
import json

from portal.jobs.models import Job, JobLogChunk, JobState
from portal.jobs.states import transition
from scheduler.adapter import run_pass

from tests.conftest import submit


def test_hold_release_and_update_a_queued_job(portal, gpuctl):
    job = submit(portal, name="train", resources={"gpus": 1}, time_limit=7200)
    held = gpuctl("hold", job.pk)
    assert held.exit_code == 0, held.stderr
    assert f"job {job.pk}: queued (Held by alice" in held.stdout
    run_pass()
    job.refresh_from_db()
    assert job.state == "queued" and job.held

    result = gpuctl("update", job.pk, "--time-limit", "30m", "--priority", "low", "--gpus", "2", "-o", "json")
    assert result.exit_code == 0, result.stderr
    (doc,) = json.loads(result.stdout)
    assert (doc["time_limit"], doc["priority"], doc["resources"]["gpus"]) == (1800, "low", 2)

    assert gpuctl("release", job.pk).exit_code == 0
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned" and job.allocations.count() == 2


def test_update_refusals_list_every_field_and_exit_2(portal, gpuctl):
    job = submit(portal, name="train")
    result = gpuctl("update", job.pk, "--time-limit", "30d", "--gpus", "64")
    assert result.exit_code == 2
    assert "time_limit: " in result.stderr and "resources.gpus: 64 exceeds the project limit" in result.stderr
    assert gpuctl("update", job.pk).exit_code == 2  # nothing to change


def test_hold_of_a_running_job_exits_5_and_outsider_4(portal, gpuctl, monkeypatch):
    job = submit(portal, resources={"gpus": 1})
    run_pass()
    result = gpuctl("hold", job.pk)
    assert result.exit_code == 5 and "only a queued job can be held" in result.stderr
    theirs = submit(portal, user="charlie", project="nlp")
    result = gpuctl("release", theirs.pk)
    assert result.exit_code == 4 and "not found" in result.stderr


def test_array_tasks_are_named_parent_underscore_index(portal, gpuctl):
    parent = submit(portal, name="sweep", array="0-2")
    task = Job.objects.get(array_parent=parent, array_index=1)
    JobLogChunk.objects.create(job=task, attempt=1, offset=0, data=b"task one says hi\n")

    shown = gpuctl("show", f"{parent.pk}_1", "-o", "json")
    assert shown.exit_code == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == task.pk
    assert gpuctl("logs", f"{parent.pk}_1").stdout == "task one says hi\n"
    listed = gpuctl("list", "--tasks").stdout
    assert f"{parent.pk}_1 " in listed and f"{parent.pk}_2 " in listed

    cancelled = gpuctl("cancel", f"{parent.pk}_1")
    assert cancelled.exit_code == 0, cancelled.stderr
    task.refresh_from_db()
    assert task.state == JobState.CANCELLED
    assert Job.objects.get(array_parent=parent, array_index=0).state == JobState.QUEUED

    missing = gpuctl("show", f"{parent.pk}_9")
    assert missing.exit_code == 4 and "not found" in missing.stderr
    bad = gpuctl("show", "3_x")
    assert bad.exit_code == 2 and "not a job id" in bad.stderr


def test_list_shows_elapsed_and_exit_code_with_reason(portal, gpuctl):
    job = submit(portal, name="crash", resources={"gpus": 1})
    run_pass()
    transition(job.pk, to=JobState.RUNNING, from_states={JobState.ASSIGNED})
    transition(job.pk, to=JobState.FAILED, from_states={JobState.RUNNING}, exit_code=137,
               reason_code="failed", reason_message="Killed by signal 9")
    table = gpuctl("list").stdout
    header, row = table.splitlines()[0], next(line for line in table.splitlines() if line.startswith(str(job.pk)))
    assert "ELAPSED" in header
    assert "exit code 137: Killed by signal 9" in row


def test_nodes_shows_gpus_by_pool_and_type(portal, gpuctl):
    submit(portal, user="charlie", project="nlp", name="theirs", resources={"gpus": 2})
    run_pass()
    out = gpuctl("nodes")
    assert out.exit_code == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert header.split() == ["POOL", "GPU", "TYPE", "NODES", "GPUS", "USED", "FREE", "UNAVAILABLE"]
    assert row.split() == ["default", "H100-80GB", "1", "ready", "8", "2", "6", "0"]
    assert "theirs" not in out.stdout and "charlie" not in out.stdout
    doc = json.loads(gpuctl("nodes", "-o", "json").stdout)
    assert doc["gpu_types"] == [{"gpu_type": "H100-80GB", "total": 8, "used": 2, "free": 6, "unavailable": 0}]


def test_usage_per_job_per_project_and_like_seff(portal, gpuctl):
    from datetime import date, timedelta
    from decimal import Decimal

    from portal.billing.services import ratecard_set, usage_meter
    from portal.core.context import Actor
    from portal.jobs.models import Allocation
    from portal.metrics.models import GpuRollup, Resolution

    ratecard_set(actor=Actor(user=portal.users["admin"]), gpu_model="H100-80GB", price_per_gpu_hour=Decimal("2"),
                 effective_from=date(2020, 1, 1))
    job = submit(portal, name="train", resources={"gpus": 2})
    submit(portal, user="charlie", project="nlp", name="theirs", resources={"gpus": 1})
    run_pass()
    # Ran an hour ago for 30 minutes at 75% utilization.
    start = Allocation.objects.filter(job=job).first().started_at - timedelta(hours=1)
    Allocation.objects.filter(job=job).update(started_at=start, released_at=start + timedelta(minutes=30))
    for a in Allocation.objects.filter(job=job):
        GpuRollup.objects.bulk_create([GpuRollup(
            gpu_id=a.gpu_id, resolution=Resolution.MINUTE, bucket=start + timedelta(minutes=m), samples=6,
            util_avg=75, util_max=80, memory_used_avg_mb=1, temperature_max_c=40, power_avg_w=100) for m in range(30)])
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED, exit_code=0, started_at=start,
                                         ended_at=start + timedelta(minutes=30))
    usage_meter()

    out = gpuctl("usage", "--since", "2020-01-01")
    assert out.exit_code == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(str(job.pk)))
    assert row.split()[-5:] == ["30m", "1.00", "75%", "2.00", "USD"]
    assert "theirs" not in out.stdout
    seff = gpuctl("usage", job.pk).stdout
    assert "GPU efficiency: 75%" in seff and "GPU-hours:" in seff and "1.000 allocated" in seff
    by_project = gpuctl("usage", "--since", "2020-01-01", "--by", "project").stdout
    assert by_project.splitlines()[0].split() == ["PROJECT", "GPU-H", "COST"]
    assert by_project.splitlines()[1].split() == ["vision", "1", "2.00"]
    assert "nlp" not in by_project
    doc = json.loads(gpuctl("usage", "--since", "2020-01-01", "-o", "json").stdout)
    assert doc["results"][0]["gpu_efficiency"] == 0.75
    assert gpuctl("usage", "--by", "project", "--mine").exit_code == 2
