"""A pass sends each node whose agent speaks protocol 1.4 all its launches in one agent.launches
message, and an older agent one agent.launch each (agents/protocol.py, LAUNCHES_SINCE)."""
import pytest

from agents.protocol import LAUNCHES_SINCE
from portal.core.context import Actor
from portal.jobs.models import Job
from portal.launch import launch_specs
from portal.jobs.services import job_submit
from portal.nodes.models import Node
from portal.nodes.services import node_add
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"


@pytest.mark.django_db(transaction=True)  # launches are published once the pass commits
def test_one_message_per_node_for_new_agents_and_one_per_job_for_older_ones(demo, sent):
    admin = Actor(user=demo.users["admin"])
    node_add(actor=admin, name="gpu-new", gpus="4xH100-80GB")
    node_add(actor=admin, name="gpu-old", gpus="4xH100-80GB")
    Node.objects.filter(name="gpu-new").update(protocol_version="%d.%d" % LAUNCHES_SINCE)
    Node.objects.filter(name="gpu-old").update(protocol_version="1.2")
    actor = Actor(user=demo.users["alice"])
    for i in range(8):
        job_submit(actor=actor, data={"project": "vision", "name": f"j{i}", "image": IMAGE, "command": ["true"],
                                      "resources": {"gpus": 1}})
    assert run_pass()["started"] == 8
    on = {node: [j.pk for j in Job.objects.filter(node__name=node)] for node in ("gpu-new", "gpu-old")}
    batches = [(node, args) for task, node, args in sent if task == "agent.launches"]
    singles = [(node, args) for task, node, args in sent if task == "agent.launch"]
    assert [node for node, _ in batches] == ["gpu-new"] and len(on["gpu-new"]) == 4
    ((_, (items,)),) = batches
    specs = launch_specs([(node, job_id) for node in on for job_id in on[node]])
    assert sorted(items, key=lambda i: int(i[0])) == [[str(j), 1, specs[("gpu-new", j)]] for j in sorted(on["gpu-new"])]
    assert sorted((node, args[0]) for node, args in singles) == sorted(("gpu-old", str(j)) for j in on["gpu-old"])
    assert all(args == [args[0], 1, specs[(node, int(args[0]))]] for node, args in singles)
