"""Placement through the whole pass on PostgreSQL: a job's GPUs stay on one node unless it asks
for several; a job that fits only if split waits 'fragmented'; a multi-node job is one gang."""
import pytest

from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.jobs.services import job_cancel
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import submit as submit_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def three_nodes(demo):
    for name in ("gpu-01", "gpu-02", "gpu-03"):
        node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus="2xH100-80GB")


def submit(demo, name, **resources):
    return submit_job(demo, name=name, resources=resources)


def nodes_of(job) -> list[str]:
    return sorted(Allocation.objects.filter(job=job, released_at__isnull=True).values_list("gpu__node__name",
                                                                                          flat=True))


def test_a_job_that_fits_only_if_split_waits_fragmented_then_starts_on_one_node(demo, three_nodes, sent, settings):
    settings.SCHEDULER_PLACEMENT = "spread"  # one 1-GPU job on each node: 3 GPUs free, none two on a node
    ones = [submit(demo, f"one{i}", gpus=1) for i in range(3)]
    run_pass()
    assert [nodes_of(j) for j in ones] == [["gpu-01"], ["gpu-02"], ["gpu-03"]]
    pair = submit(demo, "pair", gpus=2)
    result = run_pass()
    pair.refresh_from_db()
    assert pair.state == "queued" and result["fragmented"] == 1
    assert pair.reason_code == "fragmented"
    assert pair.reason_message.startswith("fragmented: 3 GPUs free but no node has 2")
    job_cancel(actor=Actor(user=demo.users["alice"]), job=ones[1])
    run_pass()
    pair.refresh_from_db()
    assert pair.state == "assigned" and nodes_of(pair) == ["gpu-02", "gpu-02"]
    launches = [(node, args[0]) for task, node, args in sent if task == "agent.launch"]
    assert [n for n, job_id in launches if job_id == str(pair.pk)] == ["gpu-02"]  # one launch: not a gang


def test_a_multi_node_job_is_one_gang_with_equal_gpus_on_each_node(demo, three_nodes, sent):
    gang = submit(demo, "gang", nodes=3, gpus_per_node=2)
    assert (gang.gpus, gang.nodes) == (6, 3)
    run_pass()
    gang.refresh_from_db()
    assert gang.state == "assigned" and nodes_of(gang) == ["gpu-01", "gpu-01", "gpu-02", "gpu-02", "gpu-03", "gpu-03"]
    specs = {node: args[2] for task, node, args in sent if task == "agent.launch"}
    assert set(specs) == {"gpu-01", "gpu-02", "gpu-03"}
    assert sorted(int(s["rendezvous"]["NODE_RANK"]) for s in specs.values()) == [0, 1, 2]
    (master,) = [node for node, s in specs.items() if s["rendezvous"]["NODE_RANK"] == "0"]
    for spec in specs.values():  # every part finds the same master: rank 0's node
        assert len(spec["gpu_indexes"]) == 2
        assert spec["rendezvous"]["MASTER_ADDR"] == master and spec["rendezvous"]["WORLD_SIZE"] == "6"
        assert spec["rendezvous"]["LOCAL_WORLD_SIZE"] == "2"
