"""Jobs through scheduling passes: assignment, cancel, dependencies, preemption, drain, logs."""
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from portal.core.context import Actor
from portal.jobs.models import Allocation, Job, JobEvent, JobLogChunk
from portal.jobs.states import transition
from portal.nodes.models import Node
from portal.jobs.node_effects import node_drain
from portal.nodes.services import node_add
from portal.tenancy.models import Quota
from scheduler.adapter import run_pass
from tests.conftest import submit


@pytest.fixture
def cluster(demo):
    admin = Actor(user=demo.users["admin"])
    node_add(actor=admin, name="gpu-01", gpus="8xH100-80GB")
    return demo


def run(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        return run_pass()


def test_pass_assigns_gpus_and_sends_launch(cluster, sent, django_capture_on_commit_callbacks):
    job = submit(cluster, resources={"gpus": 2})
    result = run(django_capture_on_commit_callbacks)
    assert result["started"] == 1
    job.refresh_from_db()
    assert job.state == "assigned" and job.node.name == "gpu-01"
    allocs = Allocation.objects.filter(job=job, released_at__isnull=True)
    assert allocs.count() == 2
    (task, node, args), = sent
    assert task == "agent.launch" and node == "gpu-01" and args[:2] == [str(job.pk), 1]
    assert sorted(args[2]["gpu_indexes"]) == sorted(a.gpu.index for a in allocs)
    assert args[2]["network"] is False and args[2]["rendezvous"] is None


def test_waiting_job_gets_reason_and_position(cluster, sent, django_capture_on_commit_callbacks):
    submit(cluster, resources={"gpus": 8})
    waiting = submit(cluster, resources={"gpus": 8})
    run(django_capture_on_commit_callbacks)
    waiting.refresh_from_db()
    assert waiting.state == "queued" and waiting.queue_position == 1
    assert waiting.reason_code and "GPU" in waiting.reason_message


def test_cancel_queued_then_again_is_409(cluster, api):
    job = submit(cluster)
    client = api("alice")
    r = client.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 202 and r.json()["state"] == "cancelled"
    assert client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 409
    assert JobEvent.objects.filter(job=job, terminal=True).count() == 1


def test_cancel_assigned_releases_gpus_and_sends_stop(cluster, api, sent, django_capture_on_commit_callbacks):
    job = submit(cluster, resources={"gpus": 4})
    run(django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        r = api("alice").post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 202
    assert not Allocation.objects.filter(job=job, released_at__isnull=True).exists()
    assert ("agent.stop", "gpu-01", [str(job.pk), 1, "cancelled", 30]) in sent


def test_exactly_one_terminal_state(cluster):
    job = submit(cluster)
    assert transition(job.pk, to="cancelled", from_states={"queued"})
    assert not transition(job.pk, to="failed", from_states={"queued", "cancelled"} - {"cancelled"})
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        JobEvent.objects.create(job=job, attempt=1, state="failed", terminal=True)


def test_failed_dependency_cancels_dependent(cluster, django_capture_on_commit_callbacks, sent):
    first = submit(cluster)
    second = submit(cluster, depends_on=[first.pk])
    run(django_capture_on_commit_callbacks)
    second.refresh_from_db()
    assert second.state == "queued" and second.reason_code == "dependency"
    Job.objects.filter(pk=first.pk).update(state="failed")
    run(django_capture_on_commit_callbacks)
    second.refresh_from_db()
    assert second.state == "cancelled" and second.reason_code == "dependency_failed"
    assert f"job {first.pk} ended failed" in second.reason_message


def test_dependency_success_lets_it_start(cluster, django_capture_on_commit_callbacks, sent):
    first = submit(cluster)
    second = submit(cluster, depends_on=[first.pk])
    Job.objects.filter(pk=first.pk).update(state="succeeded")
    run(django_capture_on_commit_callbacks)
    second.refresh_from_db()
    assert second.state == "assigned"


def test_resubmit_links_to_original(cluster, api):
    job = submit(cluster, resources={"gpus": 1})
    r = api("alice").post(f"/api/v1/jobs/{job.pk}/resubmit/")
    assert r.status_code == 201
    assert r.json()["resubmit_of"] == job.pk and r.json()["resources"]["gpus"] == 1


def test_array_throttle_and_parent_state(cluster, django_capture_on_commit_callbacks, sent):
    parent = submit(cluster, array="0-5%2", resources={"gpus": 1})
    run(django_capture_on_commit_callbacks)
    assert parent.tasks.filter(state="assigned").count() == 2
    throttled = parent.tasks.filter(state="queued").first()
    assert throttled.reason_code == "array_throttle"
    for task in parent.tasks.all():
        transition(task.pk, to="succeeded", from_states={"queued", "assigned"})
    parent.refresh_from_db()
    assert parent.state == "succeeded"


@pytest.mark.clock
def test_preemption_of_borrowed_work(cluster, settings, sent, django_capture_on_commit_callbacks, clock):
    settings.SCHEDULER_MIN_RUNTIME_S = 0
    # charlie's nlp borrows the whole node (guarantee 4, max 8) while vision is idle.
    borrowers = [submit(cluster, user="charlie", project="nlp", resources={"gpus": 2}) for _ in range(4)]
    run(django_capture_on_commit_callbacks)
    assert all(Job.objects.get(pk=b.pk).state == "assigned" for b in borrowers)
    Allocation.objects.update(started_at=timezone.now() - timedelta(hours=1))
    claim = submit(cluster, resources={"gpus": 4})  # within vision's guarantee of 8
    run(django_capture_on_commit_callbacks)
    victims = Job.objects.filter(pk__in=[b.pk for b in borrowers], attempt=2)
    assert victims.exists()
    for victim in victims:
        assert victim.state == "queued" and victim.reason_code == "preempted"
        assert ("agent.stop", "gpu-01", [str(victim.pk), 1, "preempted", 30]) in sent
        assert list(victim.events.values_list("state", flat=True))[-2:] == ["preempted", "queued"]
    run(django_capture_on_commit_callbacks)
    claim.refresh_from_db()
    assert claim.state == "assigned"
    open_allocs = Allocation.objects.filter(released_at__isnull=True)
    assert open_allocs.count() <= 8


def test_drained_node_takes_no_jobs(cluster, django_capture_on_commit_callbacks, sent):
    busy = submit(cluster, resources={"gpus": 1})
    run(django_capture_on_commit_callbacks)
    node = node_drain(actor=Actor(user=cluster.users["admin"]), node=Node.objects.get(name="gpu-01"))
    assert node.state == "draining"
    waiting = submit(cluster, resources={"gpus": 1})
    run(django_capture_on_commit_callbacks)
    waiting.refresh_from_db()
    assert waiting.state == "queued"
    assert Job.objects.get(pk=busy.pk).state == "assigned"


def test_shared_gpu_fractions_never_exceed_one(demo, django_capture_on_commit_callbacks, sent):
    node_add(actor=Actor(user=demo.users["admin"]), name="gpu-s", gpus="1xA100-80GB", shared=True)
    jobs = [submit(demo, resources={"gpus": 0.5}) for _ in range(3)]
    run(django_capture_on_commit_callbacks)
    assigned = [j for j in jobs if Job.objects.get(pk=j.pk).state == "assigned"]
    assert len(assigned) == 2
    assert sum(a.fraction for a in Allocation.objects.filter(released_at__isnull=True)) == Decimal(1)


def test_cpu_only_job_goes_to_a_node(cluster, django_capture_on_commit_callbacks, sent):
    job = submit(cluster)
    run(django_capture_on_commit_callbacks)
    job.refresh_from_db()
    assert job.state == "assigned" and job.node.name == "gpu-01"
    assert sent[0][0] == "agent.launch" and sent[0][2][2]["gpu_indexes"] == []


@pytest.mark.clock
def test_lost_launch_is_resent(cluster, settings, sent, django_capture_on_commit_callbacks, clock):
    job = submit(cluster, resources={"gpus": 1})
    run_pass()  # committed, but its on_commit publish never ran: the launch was "lost"
    assert sent == []
    Job.objects.filter(pk=job.pk).update(state_changed_at=timezone.now() - timedelta(seconds=settings.LAUNCH_RESEND_S + 1))
    run(django_capture_on_commit_callbacks)
    assert [(t, n, a[:2]) for t, n, a in sent] == [("agent.launch", "gpu-01", [str(job.pk), 1])]


def test_logs_by_offset(cluster, api):
    job = submit(cluster)
    JobLogChunk.objects.create(job=job, attempt=1, offset=0, data=b"hello ")
    JobLogChunk.objects.create(job=job, attempt=1, offset=6, data="wörld\n".encode())
    client = api("dave")
    r = client.get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert r["data"] == "hello wörld\n" and r["next_offset"] == 13 and r["complete"] is False
    r = client.get(f"/api/v1/jobs/{job.pk}/logs/?offset=6").json()
    assert r["data"] == "wörld\n"
    r = client.get(f"/api/v1/jobs/{job.pk}/logs/?offset=13").json()
    assert r["data"] == "" and r["next_offset"] == 13
    assert client.get(f"/api/v1/jobs/{job.pk}/logs/?offset=x").status_code == 400


def test_list_filters_and_stable_order(cluster, api):
    a = submit(cluster)
    b = submit(cluster, user="bob")
    Job.objects.filter(pk=b.pk).update(submitted_at=Job.objects.get(pk=a.pk).submitted_at)
    client = api("alice")
    ids = [j["id"] for j in client.get("/api/v1/jobs/").json()["results"]]
    assert ids == [b.pk, a.pk]
    assert [j["id"] for j in client.get("/api/v1/jobs/?user=bob").json()["results"]] == [b.pk]
    assert client.get("/api/v1/jobs/?state=running").json()["count"] == 0
    assert client.get("/api/v1/jobs/?state=queued,running").json()["count"] == 2
    assert client.get("/api/v1/jobs/?project=nlp").json()["count"] == 0
    assert api("charlie").get("/api/v1/jobs/").json()["count"] == 0


def test_job_list_query_count_is_flat(cluster, api, django_assert_max_num_queries):
    for _ in range(5):
        submit(cluster, array="0-2")
    client = api("alice")
    with django_assert_max_num_queries(12):
        r = client.get("/api/v1/jobs/?page_size=100")
    assert r.json()["count"] == 20


@pytest.mark.clock
def test_budget_hard_stop_holds_queued_jobs(cluster, django_capture_on_commit_callbacks, sent, clock):
    job = submit(cluster, resources={"gpus": 1})
    # 3 GPU-minutes a month, spent this month (at least 5 minutes at every instant).
    Quota.objects.filter(project=cluster.vision).update(gpu_hours_budget=Decimal("0.05"), budget_hard_stop=True)
    node = Node.objects.get(name="gpu-01")
    Allocation.objects.create(job=submit(cluster), attempt=1, gpu=node.gpus.first(),
                              started_at=clock.ago_this_month(hours=1), released_at=clock())
    run(django_capture_on_commit_callbacks)
    job.refresh_from_db()
    assert job.state == "queued" and job.reason_code == "budget"


def test_a_gang_over_two_nodes_gets_rendezvous_and_its_network(cluster, sent, django_capture_on_commit_callbacks):
    """Each part's launch names its rank; the agents join the parts on a job-private network
    (tests/agents/test_docker_driver.py) only when the project allows network."""
    node_add(actor=Actor(user=cluster.users["admin"]), name="gpu-02", gpus="8xH100-80GB")
    Quota.objects.filter(project__slug="vision").update(network_allowed=True)
    job = submit(cluster, resources={"nodes": 2, "gpus_per_node": 8}, network=True)
    run(django_capture_on_commit_callbacks)
    launches = {node: args[2] for task, node, args in sent if task == "agent.launch"}
    assert set(launches) == {"gpu-01", "gpu-02"}
    for rank, node in enumerate(sorted(launches)):
        spec = launches[node]
        assert spec["network"] is True and len(spec["gpu_indexes"]) == 8
        assert spec["rendezvous"] == {"MASTER_ADDR": "gpu-01", "MASTER_PORT": str(29500 + job.pk % 1000),
                                      "WORLD_SIZE": "16", "NODE_RANK": str(rank), "LOCAL_WORLD_SIZE": "8"}
    # The same gang in a project without network: rendezvous still, network never.
    Quota.objects.filter(project__slug="vision").update(network_allowed=False)
    job.refresh_from_db()
    from portal.launch import launch_specs
    specs = launch_specs([("gpu-01", job.pk), ("gpu-02", job.pk)])
    assert [s["network"] for s in specs.values()] == [False, False]


def test_kvm_jobs_go_only_to_kvm_nodes_and_say_so_when_there_is_none(cluster, sent, django_capture_on_commit_callbacks):
    """gpu-01 has never registered (sandbox ""): docker jobs may go there, kvm jobs may not."""
    gpu_vm = submit(cluster, resources={"gpus": 1}, sandbox="kvm")
    cpu_vm = submit(cluster, resources={"gpus": 0}, sandbox="kvm")
    plain = submit(cluster, resources={"gpus": 0})
    run(django_capture_on_commit_callbacks)
    for job in (gpu_vm, cpu_vm, plain):
        job.refresh_from_db()
    assert plain.state == "assigned" and plain.node.name == "gpu-01"
    assert gpu_vm.state == cpu_vm.state == "queued"
    assert gpu_vm.reason_code == cpu_vm.reason_code == "sandbox" and "kvm sandbox" in cpu_vm.reason_message
    node_add(actor=Actor(user=cluster.users["admin"]), name="vm-01", gpus="2xH100-80GB")
    Node.objects.filter(name="vm-01").update(sandbox="kvm")
    run(django_capture_on_commit_callbacks)
    for job in (gpu_vm, cpu_vm):
        job.refresh_from_db()
        assert job.state == "assigned" and job.node.name == "vm-01"
