"""The autoscaler's tick on PostgreSQL with the `command` provider running real programs: a provider
that fails half its creates, a node that never registers, a release racing a submit."""
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection, connections
from django.utils import timezone

from portal.autoscale import services
from portal.autoscale.models import NodePool, PoolNode, ScaleEvent
from portal.core.context import Actor
from portal.core.models import AuditEvent
from portal.jobs.models import Allocation, Job
from portal.jobs.services import job_submit
from portal.nodes.models import Node
from portal.tenancy.models import Quota
from scheduler.adapter import run_pass

IMAGE = "gpuportal/busybox:latest"

# The resume program: logs each call; fails the odd-numbered nodes ("out of stock" for the stock test).
RESUME = """
import os, sys
name = sys.argv[1]
open(os.environ["CALLS"], "a").write(f"resume {name} {os.environ['GPUPORTAL_SIM_GPUS']} "
                                      f"{bool(os.environ['GPUPORTAL_NODE_TOKEN'].startswith('gpn_'))}\\n")
if os.environ.get("FAIL_ODD") and int(name.rsplit("-", 1)[1]) % 2:
    print("InsufficientInstanceCapacity", file=sys.stderr)
    sys.exit(int(os.environ.get("FAIL_CODE", "1")))
print(f"i-{name}")
"""
SUSPEND = """
import os, sys
open(os.environ["CALLS"], "a").write(f"suspend {' '.join(sys.argv[1:])}\\n")
"""


@pytest.fixture(autouse=True)
def _postgres():
    assert connection.vendor == "postgresql", "these tests need PostgreSQL: set DATABASE_URL (make test does)"


@pytest.fixture
def calls(tmp_path, monkeypatch):
    path = tmp_path / "calls.log"
    path.touch()
    monkeypatch.setenv("CALLS", str(path))
    (tmp_path / "resume.py").write_text(RESUME)
    (tmp_path / "suspend.py").write_text(SUSPEND)
    return path


def make_pool(tmp_path, **kw) -> NodePool:
    base = dict(name="h100", provider="command", gpu_model="H100-80GB", gpus_per_node=8, sandbox="process",
                price_per_gpu_hour="2.50", max_nodes=8, max_per_step=8, boot_timeout_s=60, idle_release_s=60,
                provider_config={"resume_program": [sys.executable, str(tmp_path / "resume.py")],
                                 "suspend_program": [sys.executable, str(tmp_path / "suspend.py")]})
    return NodePool.objects.create(**{**base, **kw})


def submit(demo, n, gpus=1):
    actor = Actor(user=demo.users["alice"])
    return [job_submit(actor=actor, data={"project": "vision", "name": f"j{i}", "image": IMAGE, "command": ["true"],
                                          "resources": {"gpus": gpus, "cpus": 0.1, "memory_mb": 64}})[0]
            for i in range(n)]


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_a_provider_failing_half_its_creates_backs_the_shape_off(demo, tmp_path, calls, monkeypatch):
    monkeypatch.setenv("FAIL_ODD", "1")
    pool = make_pool(tmp_path, boot_timeout_s=900)
    Quota.objects.filter(project=demo.vision).update(max_gpus=64, max_running_jobs=64)  # demand beyond the demo's 16
    jobs = submit(demo, 32)
    run_pass()
    out = services.tick()
    # 32 one-GPU jobs: 4 nodes of 8 asked for, each through its own run of the resume program.
    assert sorted(lines(calls)) == [f"resume h100-{i} sim:8xH100-80GB True" for i in range(1, 5)]
    assert out["added"] == ["h100-2", "h100-4"]
    booting = PoolNode.objects.filter(state="booting").order_by("name")
    assert [(p.name, p.provider_id) for p in booting] == [("h100-2", "i-h100-2"), ("h100-4", "i-h100-4")]
    failed = PoolNode.objects.filter(state="failed").order_by("name")
    assert [p.name for p in failed] == ["h100-1", "h100-3"]
    assert all("InsufficientInstanceCapacity" in p.reason and p.released_at for p in failed)
    assert set(Node.objects.filter(name__in=["h100-1", "h100-3"]).values_list("state", "token_digest")) == {("down", "")}
    kinds = list(ScaleEvent.objects.order_by("id").values_list("kind", flat=True))
    assert kinds == ["scale_up", "provider_error", "provider_error", "unavailable"]
    pool.refresh_from_db()
    assert pool.failures == 1 and pool.unavailable_until > timezone.now() + timedelta(seconds=290)
    assert AuditEvent.objects.filter(action="autoscale.provider_error", object_id=str(pool.pk)).count() == 2
    # Backed off: later ticks add nothing while it lasts, whatever still waits.
    services.tick()
    services.tick(now=timezone.now() + timedelta(seconds=60))
    assert len(lines(calls)) == 4
    # What the waiting jobs say: 16 are for the two booting nodes, the rest wait for the back-off.
    run_pass()
    reasons = [Job.objects.get(pk=j.pk).reason_message for j in jobs]
    on_2 = [r for r in reasons if r.startswith("scaling up pool h100: node h100-2 booting (")]
    on_4 = [r for r in reasons if r.startswith("scaling up pool h100: node h100-4 booting (")]
    later = [r for r in reasons if r.startswith("pool h100 is unavailable until ")]
    assert len(on_2) == len(on_4) == 8 and len(later) == 16, reasons
    assert "create failed for 2 of 4 nodes" in later[0]
    # After the back-off the two missing nodes are asked for again (only those: 16 jobs are covered).
    services.tick(now=timezone.now() + timedelta(seconds=301))
    assert sorted(lines(calls)[4:]) == ["resume h100-5 sim:8xH100-80GB True", "resume h100-6 sim:8xH100-80GB True"]


def test_out_of_stock_is_told_apart_and_doubles_the_back_off(demo, tmp_path, calls, monkeypatch):
    monkeypatch.setenv("FAIL_ODD", "1")
    monkeypatch.setenv("FAIL_CODE", "75")
    pool = make_pool(tmp_path, backoff_s=100)
    submit(demo, 8)
    run_pass()
    services.tick()  # h100-1: out of stock
    pool.refresh_from_db()
    assert pool.unavailable_reason.startswith("out of stock for 1 of 1 nodes")
    first = pool.unavailable_until
    services.tick(now=first + timedelta(seconds=1))  # h100-2: created
    assert PoolNode.objects.get(name="h100-2").state == "booting"
    NodePool.objects.filter(pk=pool.pk).update(unavailable_until=None)
    pool.refresh_from_db()
    assert pool.failures == 1  # not reset until a node registers


def test_a_node_that_never_registers_is_deleted_at_its_boot_timeout(demo, tmp_path, calls):
    pool = make_pool(tmp_path, boot_timeout_s=30)
    submit(demo, 3)
    run_pass()
    t0 = timezone.now()
    services.tick(now=t0)
    assert lines(calls) == ["resume h100-1 sim:8xH100-80GB True"]
    services.tick(now=t0 + timedelta(seconds=20))  # within the boot timeout: waiting
    assert PoolNode.objects.get(name="h100-1").state == "booting" and len(lines(calls)) == 1
    out = services.tick(now=t0 + timedelta(seconds=31))
    assert out["boot_timeout"] == 1
    assert lines(calls)[1] == "suspend h100-1 i-h100-1"
    pn = PoolNode.objects.get(name="h100-1")
    assert pn.state == "failed" and "did not register within the boot timeout of 30 s" in pn.reason
    assert "waiting for its agent to register" in pn.reason
    node = Node.objects.get(name="h100-1")
    assert node.state == "down" and node.token_digest == ""
    ev = ScaleEvent.objects.get(kind="boot_timeout")
    assert ev.nodes == ["h100-1"] and ev.delta == -1
    pool.refresh_from_db()
    assert "node h100-1 never registered" in pool.unavailable_reason
    # The jobs still wait; none was ever placed on the node.
    assert not Allocation.objects.exists() and set(Job.objects.values_list("state", flat=True)) == {"queued"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round_", range(6))
def test_a_release_racing_a_submit_never_leaves_a_job_on_a_deleted_node(demo, tmp_path, calls, round_):
    """The node is idle past its idle time; a job is submitted (and a pass runs) while the tick
    releases it. Either the pass placed the job first (the node is kept) or the release drained it
    first (the job is not placed there): never a job on a node being deleted."""
    from portal.nodes.services import node_add

    pool = make_pool(tmp_path, idle_release_s=10)
    long_ago = timezone.now() - timedelta(seconds=600)
    node, _ = node_add(actor=Actor(user=None, label="test"), name="h100-1", gpus="8xH100-80GB", pool="h100",
                       cpus=16, memory_mb=65536)
    PoolNode.objects.create(pool=pool, name="h100-1", node=node, gpus=8, state="ready", created_at=long_ago,
                            registered_at=long_ago)
    NodePool.objects.filter(pk=pool.pk).update(next_index=2)
    results = {}

    def submit_and_pass():
        results["job"] = submit(demo, 1)[0]
        results["pass"] = run_pass()

    def tick():
        results["tick"] = services.tick()

    errors = []
    barrier = threading.Barrier(2)

    def wrap(fn):
        try:
            barrier.wait()
            fn()
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in (submit_and_pass, tick)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    job = Job.objects.get(pk=results["job"].pk)
    pn = PoolNode.objects.get(name="h100-1")
    on_node = Allocation.objects.filter(job=job, gpu__node__name="h100-1").exists()
    if pn.state == "released":
        assert not on_node and job.state == "queued", (job.state, results)
        assert "suspend h100-1 " in calls.read_text()
    else:
        assert pn.state == "ready" and on_node and job.state == "assigned", (pn.state, job.state, results)
        assert "suspend" not in calls.read_text()
    # Whatever happened, a later pass never places the job on a released node.
    run_pass()
    if pn.state == "released":
        assert not Allocation.objects.filter(gpu__node__name="h100-1").exists()


def test_checkpointing_jobs_are_moved_off_a_lightly_used_node_which_is_then_released(demo, tmp_path, calls):
    """Consolidation: node h100-2 runs one checkpointing job, h100-1 has room for it. The job is moved
    (its checkpoint signal and grace, then it resumes elsewhere) and h100-2 is released once empty;
    a do-not-disrupt job, or one that does not checkpoint, keeps its node."""
    from portal.jobs.states import transition
    from portal.nodes.services import node_add

    pool = make_pool(tmp_path, idle_release_s=60, max_concurrent_releases=2)
    long_ago = timezone.now() - timedelta(hours=1)
    for name in ("h100-1", "h100-2"):
        node, _ = node_add(actor=Actor(user=None, label="test"), name=name, gpus="8xH100-80GB", pool="h100",
                           cpus=16, memory_mb=65536)
        PoolNode.objects.create(pool=pool, name=name, node=node, gpus=8, state="ready", created_at=long_ago,
                                registered_at=long_ago)
    actor = Actor(user=demo.users["alice"])
    spec = {"project": "vision", "name": "c", "image": IMAGE, "command": ["true"],
            "resources": {"gpus": 1, "cpus": 0.1, "memory_mb": 64}, "checkpoint": {"signal": "SIGUSR1", "grace_s": 30}}
    no_checkpoint = {k: v for k, v in spec.items() if k != "checkpoint"}
    keep, _ = job_submit(actor=actor, data={**no_checkpoint, "resources": {"gpus": 4, "cpus": 0.1, "memory_mb": 64}})
    run_pass()  # best fit: the 4-GPU job on h100-1
    Node.objects.filter(name="h100-1").update(state="drained")
    fixed, _ = job_submit(actor=actor, data={**spec, "do_not_disrupt": True})
    run_pass()  # on h100-2
    Node.objects.filter(name="h100-1").update(state="ready")
    assert Job.objects.get(pk=fixed.pk).node.name == "h100-2" and Job.objects.get(pk=keep.pk).node.name == "h100-1"
    for j in (keep, fixed):
        transition(j.pk, to="starting", from_states={"assigned"})
        transition(j.pk, to="running", from_states={"starting"})
    Allocation.objects.update(started_at=long_ago)
    services.tick()
    assert not ScaleEvent.objects.filter(kind="consolidate").exists()  # do-not-disrupt: h100-2 stays
    Job.objects.filter(pk=fixed.pk).update(do_not_disrupt=False)
    services.tick()
    ev = ScaleEvent.objects.get(kind="consolidate")
    assert ev.nodes == ["h100-2"] and f"moving job {fixed.pk} (checkpointing)" in ev.reason
    moved = Job.objects.get(pk=fixed.pk)
    assert moved.state == "queued" and moved.attempt == 2 and moved.reason_code == "moved"
    assert Node.objects.get(name="h100-2").state in ("draining", "drained")
    assert PoolNode.objects.get(name="h100-2").state == "releasing"
    assert Job.objects.get(pk=keep.pk).state == "running"  # the other node's job is not touched
    # Once the old attempt has stopped (its allocation released), a later tick deletes the node.
    Allocation.objects.filter(job=moved, released_at__isnull=True).update(released_at=timezone.now())
    services.tick(now=timezone.now() + timedelta(seconds=30))
    assert PoolNode.objects.get(name="h100-2").state == "released"
    assert "suspend h100-2 " in calls.read_text()
    # The moved job resumes on the pool's other node.
    Job.objects.filter(pk=moved.pk).update(resume_after=None)
    run_pass()
    assert Job.objects.get(pk=moved.pk).node.name == "h100-1"


def test_boot_estimates_are_the_median_of_each_pools_last_ten_registrations(db):
    now = timezone.now()
    a = NodePool.objects.create(name="a", boot_timeout_s=600)
    b = NodePool.objects.create(name="b", boot_timeout_s=60)
    for i in range(12):  # the two oldest took 1,000 s: beyond the last ten, not counted
        took = 1000 if i < 2 else 30 + 2 * i
        created = now - timedelta(hours=12 - i)
        PoolNode.objects.create(pool=a, name=f"a-{i}", gpus=8, created_at=created,
                                registered_at=created + timedelta(seconds=took))
    PoolNode.objects.create(pool=b, name="b-0", gpus=8, created_at=now)  # never registered
    assert services.boot_estimates_s(NodePool.objects.all()) == {a.pk: 43.0, b.pk: 60.0}  # median of 34..52
