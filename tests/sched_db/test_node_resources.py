"""Node CPUs and memory through the whole pass on PostgreSQL: every job's cpus and memory_mb count
against what its node registered, less NODE_RESERVED_CPUS / NODE_RESERVED_MEMORY_MB; a job that
fits no node waits with the reason `node_resources`."""
import pytest

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.jobs.services import job_cancel
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import submit as submit_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _sent(sent):
    return sent


@pytest.fixture
def reserve(settings):
    settings.NODE_RESERVED_CPUS = 1
    settings.NODE_RESERVED_MEMORY_MB = 1024


def submit(demo, name, **resources):
    return submit_job(demo, name=name, resources=resources)


def test_cpu_only_jobs_wait_for_cpus_on_a_full_node_and_start_when_they_free(demo, reserve):
    node_add(actor=Actor(user=demo.users["admin"]), name="cpu-01", cpus=5, memory_mb=9216)  # 4 CPUs, 8 GiB
    jobs = [submit(demo, f"c{i}", gpus=0, cpus=2, memory_mb=1024) for i in range(3)]
    run_pass()
    for j in jobs:
        j.refresh_from_db()
    assert [j.state for j in jobs] == ["assigned", "assigned", "queued"]
    assert jobs[0].node.name == jobs[1].node.name == "cpu-01"
    assert jobs[2].reason_code == "node_resources"
    assert jobs[2].reason_message.startswith("Waiting for 2 CPUs and 1 GiB of memory on one node")
    job_cancel(actor=Actor(user=demo.users["alice"]), job=jobs[0])
    run_pass()
    jobs[2].refresh_from_db()
    assert jobs[2].state == "assigned" and jobs[2].node.name == "cpu-01"


def test_a_gpu_job_counts_its_memory_on_its_node_and_one_too_big_for_any_says_so(demo, reserve):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB", cpus=8, memory_mb=16384)
    first = submit(demo, "first", gpus=1, memory_mb=12288)
    second = submit(demo, "second", gpus=1, memory_mb=12288)  # a GPU is free, but not 12 GiB beside it
    huge = submit(demo, "huge", gpus=1, cpus=16)
    cpu = submit(demo, "cpu", gpus=0, cpus=1, memory_mb=2048)  # 3 GiB are left there: it fits
    run_pass()
    for j in (first, second, huge, cpu):
        j.refresh_from_db()
    assert first.state == "assigned" and cpu.state == "assigned" and cpu.node.name == "gpu-01"
    assert second.state == huge.state == "queued"
    assert second.reason_code == huge.reason_code == "node_resources"
    assert "beside its 1 GPU" in second.reason_message
    assert "more than any node with such GPUs has: the largest has 7 CPUs" in huge.reason_message


def test_a_node_of_unknown_size_takes_jobs_by_gpus_alone(demo, reserve):
    """A node added by hand whose agent has not registered yet reports no CPUs or memory: nothing to
    account until it does."""
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-02", gpus="1xH100-80GB")
    job = submit(demo, "j", gpus=1, cpus=8, memory_mb=65536)
    run_pass()
    assert Job.objects.get(pk=job.pk).state == "assigned"
