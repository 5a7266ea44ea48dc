"""The console's autoscaling page: staff only; pool sizes, demand, GPU-hours paid against used, events."""
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.autoscale.models import NodePool, PoolNode, ScaleEvent
from portal.core.context import Actor
from portal.jobs.models import Allocation
from portal.jobs.services import job_submit
from portal.nodes.services import node_add

pytestmark = pytest.mark.django_db
URL = "/console/autoscaling/"


@pytest.fixture
def books(demo):
    """A node paid for 2 hours (8 GPUs: 16 GPU-hours) that held one job's GPU for 1 hour, and a waiting job."""
    now = timezone.now()
    pool = NodePool.objects.create(name="h100", provider="command", price_per_gpu_hour="2.50", max_nodes=4,
                                   provider_config={"resume_program": "true", "suspend_program": "true"})
    node, _ = node_add(actor=Actor(user=demo.users["admin"]), name="h100-1", gpus="8xH100-80GB", pool="h100")
    PoolNode.objects.create(pool=pool, name="h100-1", node=node, gpus=8, state="released", price_per_gpu_hour="2.50",
                            created_at=now - timedelta(hours=3), registered_at=now - timedelta(hours=3),
                            released_at=now - timedelta(hours=1))
    actor = Actor(user=demo.users["alice"])
    data = {"project": "vision", "name": "j", "image": "gpuportal/busybox:latest", "command": ["true"],
            "resources": {"gpus": 1}}
    done, _ = job_submit(actor=actor, data=data)
    Allocation.objects.create(job=done, attempt=1, gpu=node.gpus.first(), started_at=now - timedelta(hours=3),
                              released_at=now - timedelta(hours=2))
    waiting, _ = job_submit(actor=actor, data={**data, "resources": {"gpus": 2}})
    type(waiting).objects.filter(pk=waiting.pk).update(reason_code="resources")
    ScaleEvent.objects.create(pool=pool, at=now - timedelta(hours=3), kind="scale_up", nodes=["h100-1"], delta=1,
                              size_after=1, reason="1 waiting jobs (1 GPUs) need 1 more node(s) of 8xH100-80GB")
    return pool


def test_staff_see_pools_books_and_events(api, books):
    r = api("admin").get(URL)
    assert r.status_code == 200
    page = r.content.decode()
    assert "8xH100-80GB (docker)" in page and "1 jobs, 2 GPUs" in page
    # 24 h: 16 GPU-hours paid (2 h x 8 GPUs) at 2.50 = 40.00; 1 GPU-hour used.
    assert "16.00 / 1.00 (cost 40.00)" in page
    assert "need 1 more node(s) of 8xH100-80GB" in page and "Scale up" in page


def test_others_may_not_see_it(api, client, books):
    assert api("alice").get(URL).status_code == 403
    assert client.get(URL).status_code == 302
