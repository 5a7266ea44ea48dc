"""gpuctl list, show, logs, cancel, resubmit and quota against a live portal."""
import json

import pytest

from portal.jobs.models import Job, JobLogChunk, JobState
from portal.jobs.states import transition
from scheduler.adapter import run_pass

from tests.conftest import submit

from .conftest import polled_again


@pytest.fixture
def running(portal):
    job = submit(portal, name="train", resources={"gpus": 1})
    run_pass()
    assert transition(job.pk, to=JobState.RUNNING, from_states={JobState.ASSIGNED})
    return job


@pytest.mark.parametrize("args", [
    ["list"], ["list", "--active", "--mine"], ["show", "{id}"], ["logs", "{id}"], ["quota"],
    ["quota", "--project", "vision"], ["whoami"], ["cancel", "{id}"], ["resubmit", "{id}"],
])
def test_json_output_is_one_parseable_document(portal, gpuctl, args):
    job = submit(portal, name="train")
    result = gpuctl(*[a.format(id=job.pk) for a in args], "-o", "json")
    assert result.exit_code == 0, result.stderr
    json.loads(result.stdout)


def test_list_filters_and_shows_why_a_job_waits(portal, gpuctl):
    submit(portal, name="big", resources={"gpus": 8})
    waiting = submit(portal, name="waiting", resources={"gpus": 8})
    submit(portal, user="bob", name="bobs")
    done = submit(portal, name="old")
    transition(done.pk, to=JobState.CANCELLED, from_states={JobState.QUEUED})
    submit(portal, user="charlie", project="nlp", name="secret")
    run_pass()

    jobs = json.loads(gpuctl("list", "-o", "json").stdout)
    assert {j["name"] for j in jobs} == {"big", "waiting", "bobs", "old"}  # nothing of nlp
    assert {j["name"] for j in json.loads(gpuctl("list", "--active", "--mine", "-o", "json").stdout)} == \
        {"big", "waiting"}
    assert [j["name"] for j in json.loads(gpuctl("list", "--state", "cancelled", "-o", "json").stdout)] == ["old"]
    table = gpuctl("list", "--active").stdout
    row = next(line for line in table.splitlines() if line.startswith(str(waiting.pk)))
    assert "queued" in row and "queue position 1: Waiting for 8 GPUs" in row
    limited = gpuctl("list", "--limit", "2")
    assert len(limited.stdout.splitlines()) == 3 and "2 of 4 shown" in limited.stderr


def test_show_gives_state_reason_position_and_timeline(portal, gpuctl, running):
    waiting = submit(portal, name="waiting", resources={"gpus": 8})
    run_pass()
    out = gpuctl("show", waiting.pk).stdout
    assert "queued [PD]" in out and "1 in queue" in out and "GPU" in out
    out = gpuctl("show", running.pk).stdout
    assert "running [R]" in out and "gpu-01" in out
    timeline = out.split("Timeline:")[1]
    assert timeline.index("submitted") < timeline.index("assigned") < timeline.index("running")


def test_logs_follow_streams_until_the_job_has_ended(portal, gpuctl, running, requests_seen, drive):
    path = f"jobs/{running.pk}/logs/"

    def the_agent():
        JobLogChunk.objects.create(job=running, attempt=1, offset=0, data=b"epoch 1\n")
        polled_again(requests_seen, path)
        JobLogChunk.objects.create(job=running, attempt=1, offset=8, data="epoch 2 ✓\n".encode())
        polled_again(requests_seen, path)
        # The agent ships the tail, then reports the end.
        JobLogChunk.objects.create(job=running, attempt=1, offset=20, data=b"done\n")
        transition(running.pk, to=JobState.SUCCEEDED, from_states={JobState.RUNNING}, exit_code=0)

    driver = drive(the_agent)
    result = gpuctl("logs", "-f", running.pk, "--interval", "0.05", "--timeout", "60")
    driver.join(30)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "epoch 1\nepoch 2 ✓\ndone\n"
    assert f"job {running.pk} succeeded" in result.stderr


def test_logs_without_follow_prints_what_is_there(portal, gpuctl, running):
    JobLogChunk.objects.create(job=running, attempt=1, offset=0, data=b"hello\n")
    assert gpuctl("logs", running.pk).stdout == "hello\n"
    doc = json.loads(gpuctl("logs", running.pk, "-o", "json").stdout)
    assert doc["data"] == "hello\n" and doc["next_offset"] == 6 and doc["complete"] is False


def test_logs_longer_than_a_page_come_whole(portal, gpuctl, running):
    """The API pages by 1 MiB; gpuctl logs (and -f) read on until they have it all, with a
    character that straddles the page boundary intact."""
    head = b"a" * (1024 * 1024 - 1)
    JobLogChunk.objects.create(job=running, attempt=1, offset=0, data=head + "✓".encode()[:1])
    JobLogChunk.objects.create(job=running, attempt=1, offset=len(head) + 1, data="✓".encode()[1:] + b" end\n")
    expected = head.decode() + "✓ end\n"
    assert gpuctl("logs", running.pk).stdout == expected
    doc = json.loads(gpuctl("logs", running.pk, "-o", "json").stdout)
    assert doc["next_offset"] == len(head) and doc["size"] == len(head) + 8  # one page, and how much more
    transition(running.pk, to=JobState.SUCCEEDED, from_states={JobState.RUNNING}, exit_code=0)
    result = gpuctl("logs", "-f", running.pk, "--interval", "0.05", "--timeout", "60")
    assert result.exit_code == 0 and result.stdout == expected


def test_cancel_then_again_is_a_conflict_exit_5(portal, gpuctl, running):
    queued = submit(portal, name="queued")
    result = gpuctl("cancel", running.pk, queued.pk)
    assert result.exit_code == 0, result.stderr
    assert f"job {running.pk}: cancelled" in result.stdout and f"job {queued.pk}: cancelled" in result.stdout
    assert set(Job.objects.values_list("state", flat=True)) == {"cancelled"}
    again = gpuctl("cancel", queued.pk)
    assert again.exit_code == 5 and "cannot be cancelled" in again.stderr


def test_outsider_gets_not_found_exit_4(portal, gpuctl, monkeypatch):
    job = submit(portal, name="alices")
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["charlie"])
    for args in (["show", job.pk], ["cancel", job.pk], ["logs", job.pk]):
        result = gpuctl(*args)
        assert result.exit_code == 4, args
        assert "not found" in result.stderr.lower()
    assert Job.objects.get(pk=job.pk).state == "queued"


def test_resubmit_prints_the_new_job_and_next_steps(portal, gpuctl):
    old = submit(portal, name="flaky", resources={"gpus": 2})
    transition(old.pk, to=JobState.CANCELLED, from_states={JobState.QUEUED})
    result = gpuctl("resubmit", old.pk)
    assert result.exit_code == 0, result.stderr
    new = Job.objects.exclude(pk=old.pk).get()
    assert new.resubmit_of_id == old.pk and new.gpus == 2
    assert f"Resubmitted job {old.pk} as job {new.pk}" in result.stdout
    assert f"gpuctl logs -f {new.pk}" in result.stdout


def test_quota_lists_my_projects_only(portal, gpuctl):
    projects = json.loads(gpuctl("quota", "-o", "json").stdout)
    assert [(p["slug"], p["role"]) for p in projects] == [("vision", "owner")]
    assert float(projects[0]["quota"]["max_gpus"]) == 16
    out = gpuctl("quota", "--project", "vision").stdout
    assert "max GPUs:" in out and "16" in out
    assert gpuctl("quota", "--project", "nlp").exit_code == 4


def test_watch_gives_up_at_the_timeout_and_the_job_goes_on(portal, gpuctl):
    job = submit(portal, name="slow")
    result = gpuctl("show", job.pk, "--watch", "--interval", "0.05", "--timeout", "0.3", "-o", "json")
    assert result.exit_code == 1
    assert "gave up after 0.3 s" in result.stderr and "queued" in result.stderr
    assert json.loads(result.stdout)["state"] == "queued"
    assert Job.objects.get(pk=job.pk).state == "queued"
