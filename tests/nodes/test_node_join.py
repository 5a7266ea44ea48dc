"""A node takes jobs only once its agent has registered and proved it receives its own queue
node.<name>: the portal sends a probe there at registration and the agent answers it."""
import pytest
from rest_framework.test import APIClient

from portal.core.context import Actor
from portal.jobs.models import Job
from portal.nodes.models import Node
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import submit as submit_job

INVENTORY = [{"index": 0, "uuid": "GPU-join-0", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}]
WAITING_QUEUE = "waiting for the agent to receive its queue node.gpu-01: check --broker and the queue folder"


@pytest.fixture(autouse=True)
def _probe_rule(settings):
    settings.TEST_NODES_SKIP_QUEUE_PROBE = False  # the real rule, as in production


class Agent(APIClient):
    """The node's agent, speaking the agent API; what the portal queues after commit runs at once."""

    def post(self, *args, **kwargs):
        with self.after_commit(execute=True):
            return super().post(*args, **kwargs)


@pytest.fixture
def agent(demo, sent, django_capture_on_commit_callbacks):
    node, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    client = Agent()
    client.after_commit = django_capture_on_commit_callbacks
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def register(agent):
    r = agent.post("/api/agent/v1/register", {"name": "gpu-01", "cpus": 8, "memory_mb": 65536, "sandbox": "docker",
                                              "gpus": INVENTORY}, format="json")
    assert r.status_code == 200, r.content
    return r


def probes(sent):
    return [args[0] for task, node, args in sent if task == "agent.probe" and node == "gpu-01"]


def answer(agent, nonce):
    return agent.post("/api/agent/v1/probe", {"nonce": nonce}, format="json")


def submit(demo):
    return submit_job(demo, resources={"gpus": 1})


def node_api(api, demo):
    r = api(token=None, username="admin").get("/api/v1/nodes/gpu-01/")
    assert r.status_code == 200
    return r.json()


def test_a_node_takes_jobs_only_after_its_agent_answers_the_probe_on_its_queue(agent, demo, sent, api):
    job = submit(demo)
    run_pass()
    assert Job.objects.get(pk=job.pk).state == "queued"  # added, no agent yet
    body = node_api(api, demo)
    assert body["schedulable"] is False and body["waiting_for"].startswith("waiting for its agent to register")

    register(agent)
    (nonce,) = probes(sent)
    run_pass()
    assert Job.objects.get(pk=job.pk).state == "queued"  # registered, but launches might never arrive
    body = node_api(api, demo)
    assert body["schedulable"] is False and body["waiting_for"] == WAITING_QUEUE
    page = api(username="admin").get("/nodes/")
    assert WAITING_QUEUE in page.content.decode()

    assert answer(agent, "0" * 32).status_code == 409  # not the probe it was sent
    r = answer(agent, nonce)
    assert r.status_code == 200 and r.json() == {"result": "verified"}
    assert answer(agent, nonce).json() == {"result": "duplicate"}  # a redelivered probe
    body = node_api(api, demo)
    assert body["schedulable"] is True and body["waiting_for"] == ""
    assert "Takes no jobs" not in api(username="admin").get("/nodes/").content.decode()
    run_pass()
    assert Job.objects.get(pk=job.pk).state == "assigned"


def test_each_registration_needs_its_own_answer(agent, sent):
    register(agent)
    answer(agent, probes(sent)[0])
    assert Node.objects.get(name="gpu-01").schedulable
    register(agent)  # the agent restarted, maybe with another --broker
    first, second = probes(sent)
    assert first != second and not Node.objects.get(name="gpu-01").schedulable
    assert answer(agent, first).status_code == 409
    assert answer(agent, second).status_code == 200 and Node.objects.get(name="gpu-01").schedulable


def test_an_unanswered_probe_is_sent_again_now_and_then(agent, sent):
    from datetime import timedelta

    from django.utils import timezone

    register(agent)

    def heartbeat():
        assert agent.post("/api/agent/v1/heartbeat", {"samples": [], "jobs": []}, format="json").status_code == 200

    heartbeat()
    assert len(probes(sent)) == 1  # just sent at registration
    Node.objects.filter(name="gpu-01").update(queue_probe_sent_at=timezone.now() - timedelta(seconds=31))
    heartbeat()
    heartbeat()
    assert len(probes(sent)) == 2 and len(set(probes(sent))) == 1  # once more, the same probe


def test_probe_input_is_checked(agent):
    register(agent)
    r = answer(agent, "not hex")
    assert r.status_code == 400 and "nonce" in r.json()["error"]["fields"]
