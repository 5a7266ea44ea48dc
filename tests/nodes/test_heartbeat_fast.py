"""The heartbeat's fast path (docs/design.md section 10): a plain body is checked by hand and must
give exactly what the serializers give; any body it is not sure of goes to them. And the node
a heartbeat authenticates from memory is checked again by its own UPDATE: a rotated token or a
removed node is refused by the next heartbeat."""
import copy
import random

import pytest
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.nodes.agent_api import HeartbeatSerializer, heartbeat_fast, samples_check
from portal.nodes.models import GPU, Node
from portal.nodes.services import node_add, node_rotate_token

PLAIN = {"gpu_uuid": "GPU-1b2c3d4e-0000-1111-2222-333344445555", "ts": 1767225600.25, "utilization": 42,
         "memory_used_mb": 1000, "memory_total_mb": 81920, "temperature_c": 61.5, "power_w": 300.0,
         "power_limit_w": 700, "ecc_errors": 0, "xid_errors": [], "processes": [{"pid": 12, "used_memory_mb": 900}]}
JOB = {"job_id": "17", "attempt": 1, "state": "running"}


def slow(body):
    """What the view does without the fast path: (samples, jobs) when the whole batch is taken."""
    data = HeartbeatSerializer(data=body)
    if not data.is_valid():
        return None
    samples, _, refused = samples_check(data.validated_data["samples"])
    return None if refused else (samples, [dict(j) for j in data.validated_data["jobs"]])


def plain(samples):
    return [{**s, "processes": [dict(p) for p in s["processes"]]} for s in samples]


def same(fast, reference) -> bool:
    return fast[1] == reference[1] and plain(fast[0]) == plain(reference[0])


@pytest.mark.parametrize("body", [
    {},
    {"samples": [], "jobs": []},
    {"samples": [PLAIN] * 40, "jobs": [JOB]},
    {"samples": [{"gpu_uuid": "GPU-0"}]},  # every optional field missing: null, or an empty list
    {"samples": [{**PLAIN, "ts": "2026-01-01T00:00:00Z", "utilization": None, "processes": []}]},
    {"samples": [{**PLAIN, "xid_errors": [79, 48], "processes": [{"pid": 1}]}]},
    {"jobs": [JOB, {"job_id": "18", "attempt": 0, "state": "starting"}]},
])
def test_the_fast_path_gives_what_the_serializers_give(body):
    fast = heartbeat_fast(copy.deepcopy(body))
    assert fast is not None
    assert same(fast, slow(copy.deepcopy(body)))


@pytest.mark.parametrize("body", [
    [],
    {"samples": [PLAIN], "extra": 1},
    {"samples": [{**PLAIN, "utilization": "42"}]},  # DRF would take a string number: the serializer decides
    {"samples": [{**PLAIN, "utilization": True}]},
    {"samples": [{**PLAIN, "utilization": 100.5}]},
    {"samples": [{**PLAIN, "memory_used_mb": 10.0}]},
    {"samples": [{**PLAIN, "utilization": float("nan")}]},
    {"samples": [{**PLAIN, "gpu_uuid": "GPU-0\n"}]},
    {"samples": [{**PLAIN, "gpu_uuid": "gone-1"}]},
    {"samples": [{**PLAIN, "ts": "2026\x00"}]},
    {"samples": [{**PLAIN, "ts": -1}]},
    {"samples": [{**PLAIN, "xid_errors": 79}]},
    {"samples": [{**PLAIN, "xid_errors": None}]},
    {"samples": [{**PLAIN, "newer_field": 1}]},
    {"samples": [{**PLAIN, "processes": [{"pid": 1, "name": "python"}]}]},
    {"samples": [PLAIN] * 257},
    {"samples": ["not a sample"]},
    {"jobs": [{**JOB, "job_id": " 17"}]},
    {"jobs": [{**JOB, "job_id": 17}]},
    {"jobs": [{**JOB, "attempt": "1"}]},
    {"jobs": [{"job_id": "17", "attempt": 1}]},
])
def test_a_body_the_fast_path_is_not_sure_of_goes_to_the_serializers(body):
    assert heartbeat_fast(copy.deepcopy(body)) is None


def test_the_fast_path_never_takes_what_the_serializers_refuse_or_change():
    """Random samples and job keys drawn from plain and odd values: whenever the fast path answers,
    the serializers take the same body whole and give the same result."""
    values = {
        "gpu_uuid": ["GPU-a", "MIG-1/2", "gone-x", "", " GPU-a", "GPU-a\n", 5, None, "x" * 64, "x" * 65],
        "ts": [0, 1e11, 1e11 + 1, -0.5, "", "2026-01-01", "x" * 41, None, True, [1]],
        "utilization": [0, 100, 100.0, 101, -1, 50.5, "50", None, False, 1e400],
        "memory_used_mb": [0, 1024 * 1024, 1024 * 1024 + 1, 5.0, "5", None, True, -1],
        "temperature_c": [-100, 250, 251, -100.5, 60.25, None, "60"],
        "ecc_errors": [0, 2**31 - 1, 2**31, 1.0, None],
        "xid_errors": [[], [79], [0, 2**31 - 1], [2**31], [-1], 79, None, ["79"], [True], [1.0]],
        "processes": [[], [{"pid": 1}], [{"pid": 1, "used_memory_mb": None}], [{"pid": -1}], [{"pid": "1"}],
                      [{"used_memory_mb": 5}], [{"pid": 1, "x": 1}], None, {}, [1]],
    }
    job_values = {"job_id": ["17", "", " 17", "17 ", 17, "x" * 33, "a\x00"], "attempt": [0, 1, -1, 2**31, "1", True],
                  "state": ["running", "", "x" * 17, None]}
    rng = random.Random(14)

    def draw(choices):  # mostly one of the first two (plain), else anything
        return rng.choice(choices[:2] if rng.random() < 0.85 else choices)

    answered = 0
    for _ in range(4000):
        sample = {k: draw(v) for k, v in values.items() if rng.random() < 0.9}
        body = {"samples": [sample]}
        if rng.random() < 0.3:
            body["jobs"] = [{k: draw(v) for k, v in job_values.items() if rng.random() < 0.97}]
        fast = heartbeat_fast(copy.deepcopy(body))
        if fast is not None:
            answered += 1
            reference = slow(copy.deepcopy(body))
            assert reference is not None and same(fast, reference), body
    assert answered > 200  # the draw does reach the fast path


@pytest.fixture
def agent(demo):
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-07", gpus="1xH100-80GB")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    client.uuid = GPU.objects.get(node__name="gpu-07").uuid
    return client


def beat(client, body=None):
    return client.post("/api/agent/v1/heartbeat", body if body is not None else {
        "samples": [{"gpu_uuid": client.uuid, "utilization": 1}], "jobs": []}, format="json")


def test_a_rotated_token_is_refused_by_the_next_heartbeat(agent, demo):
    assert beat(agent).status_code == 200  # the node is now known to this process by its token
    node = Node.objects.get(name="gpu-07")
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=None)
    secret = node_rotate_token(actor=Actor(user=demo.users["admin"]), node=node)

    assert beat(agent).status_code == 401
    assert beat(agent, {"samples": "not a list"}).status_code == 401  # nor does a bad body learn more
    assert Node.objects.get(pk=node.pk).last_heartbeat_at is None  # nothing recorded for the old token
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert beat(agent).status_code == 200
    assert Node.objects.get(pk=node.pk).last_heartbeat_at is not None


def test_a_heartbeat_sees_a_drain_made_since_the_last_one(agent):
    assert beat(agent).json()["drain"] is False
    Node.objects.filter(name="gpu-07").update(state="draining")
    assert beat(agent).json()["drain"] is True


def test_a_removed_nodes_heartbeat_is_refused(agent):
    assert beat(agent).status_code == 200
    Node.objects.filter(name="gpu-07").delete()
    assert beat(agent).status_code == 401
