"""A node token acts on its own node and GPUs only, and every number an agent sends is bounded:
a bad sample is refused alone, never the batch, and never breaks another node's heartbeat."""
import pytest
from django.core.cache import cache
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.metrics.models import GpuSample
from portal.metrics.services import samples_flush
from portal.nodes.models import GPU
from portal.nodes.services import node_add
from tests.metrics.test_metrics import sample


def agent(demo, name):
    node, secret = node_add(actor=Actor(user=demo.users["admin"]), name=name, gpus="2xH100-80GB")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    client.node, client.gpus = node, list(node.gpus.order_by("index"))
    return client


@pytest.fixture
def two(demo, monkeypatch):
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **k: None)
    return agent(demo, "gpu-01"), agent(demo, "gpu-02")


def inventory(client, **over):
    return [{"index": g.index, "uuid": g.uuid, "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559, **over}
            for g in client.gpus]


def register(client, gpus=None, **over):
    body = {"name": client.node.name, "cpus": 16, "memory_mb": 65536, "sandbox": "docker",
            "gpus": inventory(client) if gpus is None else gpus, **over}
    return client.post("/api/agent/v1/register", data=body, format="json")


def beat(client, samples):
    return client.post("/api/agent/v1/heartbeat", data={"samples": samples, "jobs": []}, format="json")


def test_register_refuses_a_gpu_of_another_node(two):
    mine, other = two
    theirs = other.gpus[0]
    gpus = inventory(mine)
    gpus[1]["uuid"] = theirs.uuid
    r = register(mine, gpus)
    assert r.status_code == 409, r.content
    assert theirs.uuid in r.json()["error"]["fields"]["gpus.1.uuid"][0]
    # Nothing moved: the other node keeps its GPU under its UUID, this node kept its own.
    assert GPU.objects.get(pk=theirs.pk).uuid == theirs.uuid
    assert sorted(GPU.objects.filter(node=mine.node).values_list("uuid", flat=True)) == sorted(
        g.uuid for g in mine.gpus)
    assert not GPU.objects.filter(uuid__startswith="gone-").exists()


def test_register_may_reorder_its_own_gpus(two):
    mine, _ = two
    a, b = mine.gpus
    gpus = inventory(mine)
    gpus[0]["uuid"], gpus[1]["uuid"] = b.uuid, a.uuid
    assert register(mine, gpus).status_code == 200
    assert dict(GPU.objects.filter(node=mine.node).values_list("index", "uuid")) == {0: b.uuid, 1: a.uuid}


def test_samples_for_another_nodes_gpus_are_refused(two):
    mine, other = two
    theirs = other.gpus[0]
    r = beat(mine, [sample(mine.gpus[0]), sample(theirs, xid_errors=[79], temperature_c=99)])
    assert r.status_code == 200, r.content
    refused = r.json()["refused"]
    assert [x["position"] for x in refused] == [1] and refused[0]["gpu_uuid"] == theirs.uuid
    assert cache.get(f"gpu-sample:{theirs.uuid}") is None  # no live tile written for it
    assert cache.get(f"gpu-sample:{mine.gpus[0].uuid}") is not None
    samples_flush()
    assert list(GpuSample.objects.values_list("gpu_id", flat=True)) == [mine.gpus[0].pk]
    assert GPU.objects.get(pk=theirs.pk).health == "healthy"


def test_a_bad_sample_is_refused_alone_and_never_breaks_another_nodes_heartbeat(two, settings):
    mine, other = two
    settings.METRICS_INGEST_BATCH = 3  # the bad node's rows wait in the buffer the next heartbeat flushes
    r = beat(other, [sample(other.gpus[0], memory_used_mb=9e11), sample(other.gpus[1])])
    assert r.status_code == 200, r.content
    assert [(x["position"], list(x["errors"])) for x in r.json()["refused"]] == [(0, ["memory_used_mb"])]
    assert cache.get(f"gpu-sample:{other.gpus[0].uuid}") is None
    r = beat(mine, [sample(mine.gpus[0])])
    assert r.status_code == 200, r.content
    assert r.json()["refused"] == []
    samples_flush()
    assert sorted(GpuSample.objects.values_list("gpu_id", flat=True)) == sorted([other.gpus[1].pk,
                                                                                 mine.gpus[0].pk])


@pytest.mark.parametrize("over,field", [
    ({"utilization": 101}, "utilization"),
    ({"utilization": -1}, "utilization"),
    ({"utilization": "high"}, "utilization"),
    ({"memory_used_mb": 9e11}, "memory_used_mb"),
    ({"memory_total_mb": 2**40}, "memory_total_mb"),
    ({"temperature_c": 1e6}, "temperature_c"),
    ({"power_w": -5}, "power_w"),
    ({"power_limit_w": 1e9}, "power_limit_w"),
    ({"ecc_errors": 2**40}, "ecc_errors"),
    ({"ecc_errors": -1}, "ecc_errors"),
    ({"xid_errors": ["²"]}, "xid_errors.0"),
    ({"xid_errors": [-79]}, "xid_errors.0"),
    ({"xid_errors": [79] * 2000}, "xid_errors"),
    ({"processes": [{"pid": -1}]}, "processes.0.pid"),
    ({"processes": [{"pid": 1, "used_memory_mb": 2**40}]}, "processes.0.used_memory_mb"),
    ({"ts": "x" * 100}, "ts"),
    ({"ts": True}, "ts"),
    ({"gpu_uuid": "gone-1234"}, "gpu_uuid"),
    ({"gpu_uuid": 7.5}, "gpu_uuid"),
])
def test_out_of_range_sample_fields_are_refused_by_name(two, over, field):
    mine, _ = two
    r = beat(mine, [sample(mine.gpus[0], **over), sample(mine.gpus[1])])
    assert r.status_code == 200, r.content
    refused = r.json()["refused"]
    assert [x["position"] for x in refused] == [0] and field in refused[0]["errors"], refused
    samples_flush()
    assert list(GpuSample.objects.values_list("gpu_id", flat=True)) == [mine.gpus[1].pk]


def test_a_sample_that_is_not_an_object_refuses_the_heartbeat(two):
    mine, _ = two
    r = beat(mine, [sample(mine.gpus[0]), 5])
    assert r.status_code == 400 and "samples" in str(r.json()["error"]["fields"])


@pytest.mark.parametrize("over,field", [
    ({"cpus": 2**40}, "cpus"),
    ({"memory_mb": 2**40}, "memory_mb"),
    ({"memory_mb": -1}, "memory_mb"),
    ({"capabilities": {"\x00": True}}, "capabilities"),
    ({"capabilities": {f"c{i}": True for i in range(100)}}, "capabilities"),
])
def test_register_bounds_node_figures(two, over, field):
    mine, _ = two
    r = register(mine, **over)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"]


@pytest.mark.parametrize("change,field", [
    (lambda gpus: gpus[0].update(memory_mb=2**40), "gpus.0.memory_mb"),
    (lambda gpus: gpus[0].update(index=256), "gpus.0.index"),
    (lambda gpus: gpus[1].update(index=0), "gpus.1.index"),
    (lambda gpus: gpus[1].update(uuid=gpus[0]["uuid"]), "gpus.1.uuid"),
    (lambda gpus: gpus[0].update(uuid="gone-abc"), "gpus.0.uuid"),
    (lambda gpus: gpus[0].update(uuid="GPU\x00"), "gpus.0.uuid"),
    (lambda gpus: gpus[0].update(colour="red"), "gpus.0.colour"),
])
def test_register_bounds_gpu_inventory(two, change, field):
    mine, _ = two
    gpus = inventory(mine)
    change(gpus)
    before = list(GPU.objects.order_by("pk").values_list("pk", "node_id", "index", "uuid", "memory_mb"))
    r = register(mine, gpus)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert list(GPU.objects.order_by("pk").values_list("pk", "node_id", "index", "uuid", "memory_mb")) == before


@pytest.mark.parametrize("path,body,field", [
    ("jobs/1/confirm", {"attempt": 2**40}, "attempt"),
    ("jobs/1/events", {"attempt": 1, "state": "running", "exit_code": 2**40}, "exit_code"),
    ("heartbeat", {"jobs": [{"job_id": "1", "attempt": 2**40, "state": "running"}]}, "jobs.0.attempt"),
])
def test_report_numbers_are_bounded(two, path, body, field):
    mine, _ = two
    r = mine.post(f"/api/agent/v1/{path}", data=body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"]


@pytest.mark.parametrize("job_id", ["²", "١٢", "99999999999999999999999"])
def test_odd_job_ids_in_reports_are_stale_not_500(two, job_id):
    mine, _ = two
    r = mine.post(f"/api/agent/v1/jobs/{job_id}/confirm", data={"attempt": 1}, format="json")
    assert r.status_code == 409, r.content
    r = mine.post("/api/agent/v1/heartbeat", data={"jobs": [{"job_id": job_id, "attempt": 1, "state": "running"}]},
                  format="json")
    assert r.status_code == 200 and [s["job_id"] for s in r.json()["stop"]] == [job_id]
