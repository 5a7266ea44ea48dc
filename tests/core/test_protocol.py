"""agents/protocol.py is the one contract between the portal and its agents: these fail when a
side grows its own copy of a rule again, or when the agent or the scheduler core starts to import
the portal."""
import ast
from pathlib import Path

import pytest
from rest_framework import serializers
from rest_framework.test import APIClient

from agents import protocol
from agents.sandbox import LaunchSpec, job_env
from portal.core.context import Actor
from portal.jobs.models import TERMINAL, JobState
from portal.jobs.reports import AGENT_TERMINAL
from portal.jobs.spec import JobSpecSerializer
from portal.agentapi.jobs import EventSerializer
from portal.nodes.services import node_add
from scheduler.core import sandbox_hosts as scheduler_hosts

ROOT = Path(__file__).resolve().parents[2]
ENV_NAMES = ["LD_PRELOAD", "ld_preload", "Ld_Library_Path", "CUDA_VISIBLE_DEVICES", "cuda_mps_pipe_directory",
             "NVIDIA_VISIBLE_DEVICES", "nvidia_driver_capabilities", "GPUPORTAL_JOB_ID", "gpuportal_attempt",
             "MASTER_ADDR", "master_port", "World_Size", "NODE_RANK", "local_world_size",
             "RANK", "LOCAL_RANK", "PATH", "HOME", "MY_CUDA_HOME", "OLD_LD_PATH", "CUDA", "LD", "MASTER"]


def portal_refuses(name: str) -> bool:
    try:
        JobSpecSerializer().validate_env({name: "x"})
    except serializers.ValidationError as exc:
        assert "is reserved" in str(exc.detail[0])
        return True
    return False


def agent_drops(name: str) -> bool:
    spec = LaunchSpec(job_id="j1", attempt=1, image="img", command=["true"], env={name: "tenant"})
    return job_env(spec, visible_devices=[]).get(name) != "tenant"


@pytest.mark.parametrize("name", ENV_NAMES)
def test_portal_refuses_exactly_the_env_names_the_agent_drops(name):
    assert portal_refuses(name) == agent_drops(name) == protocol.is_reserved_env(name)


def test_reserved_env_rule_covers_the_gpu_stack_the_loader_and_the_rendezvous():
    assert all(protocol.is_reserved_env(n) for n in ("ld_preload", "Cuda_X", "NVIDIA_X", "gpuportal_x", "master_addr"))
    assert not any(protocol.is_reserved_env(n) for n in ("RANK", "PATH", "LDX", "MY_LD_PATH"))


def test_the_portal_accepts_in_reports_exactly_the_protocols_states():
    field = EventSerializer().fields["state"]
    assert list(field.choices) == list(protocol.EVENT_STATES)
    assert set(AGENT_TERMINAL) == protocol.TERMINAL_EVENT_STATES
    # Every agent state is a portal state, and one that ends an attempt is terminal there too.
    assert set(protocol.EVENT_STATES) <= set(JobState.values)
    assert protocol.TERMINAL_EVENT_STATES <= set(TERMINAL)
    assert protocol.TERMINAL_EVENT_STATES < set(protocol.EVENT_STATES)


def test_scheduler_places_jobs_on_the_node_sandboxes_the_agent_runs_them_in():
    assert set(protocol.JOB_SANDBOXES) <= set(protocol.NODE_SANDBOXES)
    for sandbox in protocol.JOB_SANDBOXES:
        # The scheduler adds only the node whose agent has not registered yet ("").
        assert set(scheduler_hosts(sandbox)) - {""} == set(protocol.sandbox_hosts(sandbox)), sandbox
        assert set(protocol.sandbox_hosts(sandbox)) <= set(protocol.NODE_SANDBOXES)
    assert "" not in scheduler_hosts("kvm")  # a VM job never lands on a node of unknown kind
    assert list(JobSpecSerializer().fields["sandbox"].choices) == list(protocol.JOB_SANDBOXES)


def imported_tops(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("folder", ["agents", "scheduler/core", "scheduler/sim"])
def test_agent_and_scheduler_core_import_neither_the_portal_nor_django(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(imported_tops(f) & {"portal", "django", "rest_framework", "celery_app"})
           for f in files}
    assert {f: b for f, b in bad.items() if b} == {}


def test_the_import_walk_sees_function_level_imports(tmp_path):
    sneaky = tmp_path / "x.py"
    sneaky.write_text("def f():\n    from portal.jobs import models\n    import django.db\n")
    assert imported_tops(sneaky) == {"portal", "django"}


@pytest.fixture
def node_api(demo):
    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-01", gpus="1xH100-80GB")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def register(client, **extra):
    return client.post("/api/agent/v1/register", format="json", data={
        "name": "gpu-01", "cpus": 8, "memory_mb": 32768, "sandbox": "docker", **extra,
        "gpus": [{"index": 0, "uuid": "GPU-p-0", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}]})


@pytest.mark.parametrize("version", [None, protocol.PROTOCOL_VERSION, "1.99"])
def test_register_accepts_the_same_major_and_agents_older_than_the_field(node_api, version):
    r = register(node_api, **({} if version is None else {"protocol_version": version}))
    assert r.status_code == 200, r.content
    assert r.json()["protocol_version"] == protocol.PROTOCOL_VERSION


@pytest.mark.parametrize("version, says", [("2.0", "speaks agent protocol"), ("0.9", "speaks agent protocol"),
                                           ("one", "is not a MAJOR.MINOR version"), ("1", "MAJOR.MINOR")])
def test_register_refuses_another_major_naming_the_field(node_api, version, says):
    r = register(node_api, protocol_version=version)
    assert r.status_code == 400, r.content
    assert says in r.json()["error"]["fields"]["protocol_version"][0]


@pytest.mark.django_db(transaction=True)
def test_the_real_agent_client_registers_with_its_version_at_the_live_portal(live_server, demo):
    """The agent's own client against the real agent API: the portal answers the version it speaks."""
    from agents.client import PortalClient

    _, secret = node_add(actor=Actor(user=demo.users["admin"]), name="gpu-live")
    answer = PortalClient(live_server.url, secret, retries=0).register(
        name="gpu-live", cpus=2, memory_mb=4096, sandbox="process", gpus=[])
    assert answer["node"] == "gpu-live"
    assert protocol.protocol_major(answer["protocol_version"]) == protocol.protocol_major(protocol.PROTOCOL_VERSION)
