"""The message shapes of agents/protocol.py hold on both sides: the agent API's serializers declare
exactly them, the real agent client talks to the real agent API (no stub in between), and the
tests' stand-ins for the portal (FakePortal, PortalStub) answer as the real API does."""
import inspect
import re

import pytest
from django.urls import resolve
from rest_framework import serializers

from agents import protocol
from agents.client import PortalClient
from portal.core.context import Actor
from portal.jobs.models import Job, JobLogChunk
from portal.jobs.services import job_submit
from portal.agentapi import images as agent_images
from portal.agentapi import jobs as agent_jobs
from portal.nodes import agent_api
from portal.nodes.models import Node
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.agents.fakes import FakePortal
from tests.agents.portal_stub import PortalStub

IMAGE = "gpuportal/busybox:latest"


def agent_serializers() -> dict:
    return {cls.message: cls for module in (agent_api, agent_jobs, agent_images) for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, serializers.Serializer) and hasattr(cls, "message")}


def test_every_protocol_message_has_one_serializer_declaring_exactly_its_keys():
    found = agent_serializers()
    assert set(found) == set(protocol.MESSAGES)
    for message, cls in found.items():
        fields = cls().fields
        assert list(fields) == list(message.fields) or set(fields) == set(message.fields), cls
        assert {n for n, f in fields.items() if f.required} == set(message.required), cls


def test_a_serializer_that_drifts_from_the_protocol_stops_the_portal():
    class Missing(serializers.Serializer):
        attempt = serializers.IntegerField()

    class Optional(serializers.Serializer):
        attempt = serializers.IntegerField(required=False)
        state = serializers.CharField()

    with pytest.raises(Exception, match="agents.protocol's message"):
        agent_api.speaks(protocol.EVENT)(Missing)
    with pytest.raises(Exception, match=r"required here or there only: \['attempt'\]"):
        agent_api.speaks(protocol.Message("x", ("attempt", "state")))(Optional)


def test_the_contract_supplies_the_choices_and_limits():
    fields = agent_jobs.EventSerializer().fields
    assert list(fields["state"].choices) == list(protocol.EVENT_STATES)
    assert fields["message"].max_length == protocol.EVENT_MESSAGE_MAX
    assert fields["node_problem"].max_length == protocol.NODE_PROBLEM_MAX
    assert list(agent_api.RegisterSerializer().fields["sandbox"].choices) == list(protocol.NODE_SANDBOXES)


def test_the_client_sends_no_key_outside_its_message():
    with pytest.raises(ValueError, match="unknown keys"):
        protocol.EVENT.body(attempt=1, state="running", colour="red")
    with pytest.raises(ValueError, match="missing"):
        protocol.EVENT.body(state="running")


@pytest.mark.django_db(transaction=True)
def test_the_real_agent_client_runs_a_job_through_the_real_agent_api(live_server, demo, sent, passes_here):
    """Register, heartbeat, confirm, events and a log chunk: PortalClient against the live portal."""
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-live")
    client = PortalClient(live_server.url, secret, retries=0)
    answer = client.register(name="gpu-live", cpus=8, memory_mb=32768, sandbox="process", gpus=[
        {"index": 0, "uuid": "GPU-live-0", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}])
    assert answer["node"] == "gpu-live"
    assert Node.objects.get(name="gpu-live").protocol_version == protocol.PROTOCOL_VERSION

    job, _ = job_submit(actor=Actor(user=demo.users["alice"]), data={
        "project": "vision", "name": "live", "image": IMAGE, "command": ["echo", "hi"], "resources": {"gpus": 1}})
    assert run_pass()["started"] == 1
    job.refresh_from_db()
    assert job.node.name == "gpu-live"

    beat = client.heartbeat(samples=[{"gpu_uuid": "GPU-live-0", "utilization": 50, "temperature_c": 40}],
                            jobs=[{"job_id": str(job.pk), "attempt": job.attempt, "state": "starting"}])
    assert beat["refused"] == [] and beat["drain"] is False
    spec = client.confirm(str(job.pk), job.attempt)
    assert spec["image"] == IMAGE and spec["command"] == ["echo", "hi"]
    client.event(str(job.pk), job.attempt, "running")
    assert client.logs(str(job.pk), job.attempt, 0, b"hi\n")["stored"] is True
    client.event(str(job.pk), job.attempt, "succeeded", exit_code=0)
    job.refresh_from_db()
    assert job.state == "succeeded" and job.exit_code == 0
    assert b"".join(bytes(c.data) for c in JobLogChunk.objects.filter(job=job)) == b"hi\n"


def agent_schema(client) -> dict:
    return client.get("/api/schema/", {"format": "json"}).json()


def answer_keys(schema: dict, path: str) -> set[str]:
    """The keys the real agent API documents in its 200 answer at `path`."""
    operation = schema["paths"][f"/api/agent/v1/{path}"]["post"]
    content = operation["responses"]["200"]["content"]["application/json"]["schema"]
    if "$ref" in content:
        content = schema["components"]["schemas"][content["$ref"].rsplit("/", 1)[1]]
    return set(content.get("properties", {}))


def batch_result_keys(schema: dict) -> set[str]:
    """The keys the real agent API documents for each report's result in a batch (POST events)."""
    return set(schema["components"]["schemas"]["EventResult"]["properties"])


def test_fake_portal_has_the_real_clients_methods_and_arguments():
    for name in ("register", "heartbeat", "confirm", "event", "event_batch", "logs"):
        real = inspect.signature(getattr(PortalClient, name))
        fake = inspect.signature(getattr(FakePortal, name))
        real_names = [p for p in real.parameters if p != "self"]
        fake_names = [p for p in fake.parameters if p not in ("self", "body")]
        # register(**body) takes whatever the client sends; every other method names what it takes.
        assert name == "register" or fake_names == real_names, name


@pytest.mark.django_db
def test_the_stand_ins_answer_only_what_the_real_agent_api_answers(client):
    schema = agent_schema(client)
    stub = PortalStub()
    fake = FakePortal(clock=lambda: 0.0)
    try:
        report = {"job_id": "7", "attempt": 1, "state": "running"}
        for path, body in (("register", {}), ("probe", {}), ("heartbeat", {}), ("jobs/7/confirm", {"attempt": 1}),
                           ("jobs/7/events", {"attempt": 1}), ("jobs/7/logs", {"attempt": 1}),
                           ("events", {"events": [report]})):
            match = resolve(f"/api/agent/v1/{path}")  # the stub's route exists in the real API
            assert match.namespace == "agent", path
            status, answer = stub.answer(f"/api/agent/v1/{path}", body)
            assert status == 200
            documented = answer_keys(schema, re.sub(r"/7/", "/{job_id}/", path))
            assert set(answer) <= documented, (path, set(answer) - documented)
            if path == "events":
                assert answer["results"] and all(set(r) <= batch_result_keys(schema) for r in answer["results"])
        fake_answers = {"register": fake.register(name="n"), "heartbeat": fake.heartbeat(samples=[], jobs=[]),
                        "jobs/{job_id}/logs": fake.logs("7", 1, 0, b"x")}
        for path, answer in fake_answers.items():
            assert set(answer) <= answer_keys(schema, path), path
        # The client hands on the batch's "results"; the fake gives what the client gives.
        assert all(set(r) <= batch_result_keys(schema) for r in fake.event_batch([report])), "event_batch"
    finally:
        stub.close()
