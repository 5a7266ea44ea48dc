"""Topology-aware placement through the whole pass on PostgreSQL: the GPUs a job gets within a node
follow the topology its agent registered, and the job records how closely they are linked."""
import pytest

from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.nodes.models import GPU
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import submit as submit_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _quiet(quiet):
    return quiet


def submit(demo, name, gpus):
    return submit_job(demo, name=name, resources={"gpus": gpus})


def indexes(job) -> list[int]:
    return sorted(Allocation.objects.filter(job=job).values_list("gpu__index", flat=True))


def test_a_job_gets_gpus_of_one_nvlink_group_and_records_it(demo, api):
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="8xH100-80GB")
    # Even and odd GPUs form the two NVLink groups (so the lowest free indexes would be the wrong pick).
    for gpu in GPU.objects.filter(node=node):
        GPU.objects.filter(pk=gpu.pk).update(topology={"nvlink": gpu.index % 2, "pcie": gpu.index // 2,
                                                       "numa": gpu.index % 2})
    pair, quad = submit(demo, "pair", 2), submit(demo, "quad", 4)
    result = run_pass()
    pair.refresh_from_db()
    quad.refresh_from_db()
    assert indexes(pair) == [0, 2] and indexes(quad) == [1, 3, 5, 7]
    assert pair.placement_topology == quad.placement_topology == "nvlink"
    assert result["placements_by_topology"] == {"nvlink": 2}
    # The two left (4 and 6) share an NVLink group too.
    last = submit(demo, "last", 2)
    run_pass()
    last.refresh_from_db()
    assert indexes(last) == [4, 6] and last.placement_topology == "nvlink"
    r = api(username="alice").get(f"/api/v1/jobs/{pair.pk}/")
    assert r.status_code == 200 and r.json()["placement_topology"] == "nvlink"
    page = api(username="alice").get(f"/jobs/{pair.pk}/")
    assert page.status_code == 200 and "<dt>GPUs linked</dt><dd>one NVLink group</dd>" in page.content.decode()


def test_without_a_reported_topology_nothing_is_recorded(demo):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="2xH100-80GB")
    pair = submit(demo, "pair", 2)
    result = run_pass()
    pair.refresh_from_db()
    assert indexes(pair) == [0, 1] and pair.placement_topology == "" and result["placements_by_topology"] == {}
