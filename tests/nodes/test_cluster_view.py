"""The cluster view every user may open (like sinfo): GPUs by pool and type, counts only."""

import pytest
from django.test import Client

from portal.core.context import Actor
from portal.jobs.services import job_submit
from portal.nodes.models import GPU, GPUHealth, Node
from portal.jobs.node_effects import node_drain
from portal.nodes.services import node_add
from scheduler.adapter import run_pass
from tests.conftest import make_token


@pytest.fixture
def fleet(demo, monkeypatch):
    """gpu-01: 8 H100 (pool default), gpu-02: 4 A100 (pool batch) drained, one H100 unhealthy;
    bob runs a 3-GPU job, charlie queues 8 GPUs."""
    monkeypatch.setattr("scheduler.dispatch._send", lambda *a, **kw: None)
    admin = Actor(user=demo.users["admin"])
    node_add(actor=admin, name="gpu-01", gpus="8xH100-80GB")
    node_add(actor=admin, name="gpu-02", gpus="4xA100-40GB", pool="batch")
    node_drain(actor=admin, node=Node.objects.get(name="gpu-02"), reason="driver upgrade")
    GPU.objects.filter(node__name="gpu-01", index=7).update(health=GPUHealth.UNHEALTHY, health_reason="Xid 79")
    for user, project, gpus in (("bob", "vision", 3), ("charlie", "nlp", 8)):
        job_submit(actor=Actor(user=demo.users[user]), data={
            "project": project, "name": f"secret-{user}", "image": "gpuportal/busybox:latest", "command": ["true"],
            "resources": {"gpus": gpus}})
    run_pass()
    return demo


def test_every_user_sees_free_and_used_gpus_by_pool_and_type(fleet, api):
    for user in ("dave", "charlie", "bob"):
        r = api(user).get("/api/v1/cluster/")
        assert r.status_code == 200, r.content
    body = r.json()
    assert body["gpu_types"] == [
        {"gpu_type": "A100-40GB", "total": 4, "used": 0, "free": 0, "unavailable": 4},
        {"gpu_type": "H100-80GB", "total": 8, "used": 3, "free": 4, "unavailable": 1},
    ]
    batch, default = body["pools"]
    assert (batch["pool"], batch["node_states"], batch["unavailable"]) == ("batch", {"drained": 1}, 4)
    assert (default["pool"], default["nodes"], default["used"], default["free"]) == ("default", 1, 3, 4)
    assert body["nodes"] == {"ready": 1, "draining": 0, "drained": 1, "down": 0}
    assert body["jobs"] == {"queued": 1, "queued_gpus": 8, "running": 1}
    assert isinstance(default["used"], int)  # whole GPUs are integers, not 3.0


def test_cluster_reveals_no_tenant(fleet, api):
    text = api("dave").get("/api/v1/cluster/").content.decode()
    for secret in ("secret-", "bob", "charlie", "vision", "nlp", "alice"):
        assert secret not in text


def test_anonymous_gets_401_and_a_read_token_is_enough(fleet, api):
    assert api().get("/api/v1/cluster/").status_code in (401, 403)
    token = make_token(fleet.users["charlie"], scopes=("read",))
    assert api(token=token).get("/api/v1/cluster/").status_code == 200
    assert api(token=token).post("/api/v1/cluster/", {}, format="json").status_code in (403, 405)


def test_cluster_page_is_in_everyones_nav(fleet):
    client = Client()
    client.force_login(fleet.users["dave"])
    home = client.get("/").content.decode()
    assert 'href="/cluster/"' in home
    page = client.get("/cluster/").content.decode()
    assert "H100-80GB" in page and "A100-40GB" in page and "1 drained" in page
    assert "secret-" not in page and "charlie" not in page
    assert Client().get("/cluster/").status_code == 302  # to the login page
