"""Dataset locality through the whole pass on PostgreSQL: the snapshot reads the nodes' cached
datasets and the jobs' datasets, the job goes to the node holding its data, a job waiting for a
busy holder says so, and a node reserved for a job is asked to prefetch what it lacks."""
import pytest

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job
from portal.jobs.services import job_submit
from portal.nodes.models import Node
from portal.nodes.services import node_add
from portal.storage.models import Dataset, DatasetVersion, DatasetVersionState
from portal.tenancy.models import Project
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"
DIGEST = "ab" * 32
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_nodes(demo, settings):
    settings.SCHEDULER_LOCALITY_WAIT_S = 3600
    for name in ("gpu-01", "gpu-02"):
        node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus="2xH100-80GB")
    version = DatasetVersion.objects.create(
        dataset=Dataset.objects.create(project=Project.objects.get(slug="vision"), name="imagenet"), version=3,
        source="http", url="http://127.0.0.1:9/imagenet.tar", archive=True, state=DatasetVersionState.READY,
        digest=DIGEST, size=10**9, files=[{"path": "imagenet.tar", "size": 10**9, "sha256": "cd" * 32}])
    return version


def submit(demo, name, gpus=1, datasets=True):
    job = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": name, "image": IMAGE, "command": ["true"], "resources": {"gpus": gpus}})[0]
    if datasets:  # as submit resolves "imagenet@3" (portal.storage.datasets.resolve_job_datasets)
        Job.objects.filter(pk=job.pk).update(datasets=[
            {"name": "imagenet", "version": 3, "digest": DIGEST, "size": 10**9, "source": "http://..."}])
    return job


def nodes_of(job) -> list[str]:
    return sorted(Allocation.objects.filter(job=job, released_at__isnull=True).values_list("gpu__node__name",
                                                                                          flat=True))


def test_a_job_goes_to_the_node_whose_cache_holds_its_dataset(demo, two_nodes, sent):
    Node.objects.filter(name="gpu-02").update(cached_datasets=[DIGEST])
    job = submit(demo, "reads")
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned" and nodes_of(job) == ["gpu-02"]


def test_a_job_waits_for_the_busy_holder_says_so_and_its_node_is_asked_to_prefetch(demo, two_nodes, sent,
                                                                                     settings):
    Node.objects.filter(name="gpu-01").update(cached_datasets=[DIGEST])
    hog = submit(demo, "hog", gpus=2, datasets=False)
    run_pass()
    assert nodes_of(hog) == ["gpu-01", "gpu-01"]  # best fit: the first node
    job = submit(demo, "reads")
    run_pass()
    job.refresh_from_db()
    assert job.state == "queued" and job.reason_code == "locality"
    assert job.reason_message.startswith("Waiting up to ") and "for a node that holds imagenet@3 (gpu-01" in \
        job.reason_message
    # With no wait it takes the other node at once; the node is told nothing (it starts, it does not wait).
    settings.SCHEDULER_LOCALITY_WAIT_S = 0
    run_pass()
    job.refresh_from_db()
    assert job.state == "assigned" and nodes_of(job) == ["gpu-02"]
    assert not [m for m in sent if m[0] == "agent.prefetch"]


def test_a_node_reserved_for_a_job_is_asked_once_to_prefetch_its_dataset(demo, two_nodes, sent, settings):
    settings.SCHEDULER_PREFETCH_HORIZON_S = 10**9  # the hogs' time limits are an hour away
    hogs = [submit(demo, f"hog{i}", gpus=2, datasets=False) for i in range(2)]
    run_pass()
    assert [nodes_of(h) for h in hogs] == [["gpu-01", "gpu-01"], ["gpu-02", "gpu-02"]]
    big = submit(demo, "big", gpus=2)
    run_pass()
    big.refresh_from_db()
    assert big.state == "queued" and big.reason_code == "resources" and "reserved for it" in big.reason_message
    (prefetch,) = [(node, args) for task, node, args in sent if task == "agent.prefetch"]
    node, (entries,) = prefetch
    assert node in ("gpu-01", "gpu-02")
    assert [(e["name"], e["version"], e["digest"], e["size"]) for e in entries] == [("imagenet", 3, DIGEST, 10**9)]
    assert entries[0]["files"][0]["url"] == "http://127.0.0.1:9/imagenet.tar"
    submit(demo, "later", gpus=2, datasets=False)  # a full pass again, the same reservation
    run_pass()
    assert len([m for m in sent if m[0] == "agent.prefetch"]) == 1  # the node is not asked again
