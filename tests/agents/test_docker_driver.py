"""The docker sandbox against the real engine (see conftest: no engine = failure)."""

import time

import docker.errors
import pytest

from agents.sandbox import EXITED, OOM, RUNNING, SandboxError
from agents.sandbox.docker_driver import SandboxExists
from agents.sandbox.kvm_domain import driver_dir
from tests.agents.conftest import make_spec, wait_done
from tests.agents.node_services import node_services, probe_command, probe_lines  # noqa: F401


def wait_log(driver, handle, text, timeout=15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in driver.read_logs(handle, 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in the log: {driver.read_logs(handle, 0)!r}")


def test_job_output_and_exit_code_come_back(docker_driver):
    h = docker_driver.launch(make_spec(command=["sh", "-c", "echo hello; echo oops >&2"]))
    assert wait_done(docker_driver, h) == (EXITED, 0)
    logs = docker_driver.read_logs(h, 0)
    assert b"hello\n" in logs and b"oops\n" in logs
    assert docker_driver.read_logs(h, 6) == logs[6:]


def test_failing_command_gives_its_exit_code(docker_driver):
    h = docker_driver.launch(make_spec(command=["sh", "-c", "exit 7"]))
    assert wait_done(docker_driver, h) == (EXITED, 7)


def test_missing_executable_fails_with_a_readable_error(docker_driver):
    # docker-init execs the command, so this is an exit (127) with a message, not a start error.
    h = docker_driver.launch(make_spec(command=["no-such-binary"]))
    state, code = wait_done(docker_driver, h)
    assert state == EXITED and code != 0
    assert b"no-such-binary" in docker_driver.read_logs(h, 0)


def test_memory_over_the_limit_is_oom(docker_driver):
    # sort holds its whole input: 200 MB against a 32 MB limit.
    h = docker_driver.launch(make_spec(memory_mb=32, command=["sh", "-c", "head -c 200000000 /dev/zero | sort"]))
    state, code = wait_done(docker_driver, h, timeout=60)
    assert state == OOM and code == 137


def test_an_oom_kill_the_engine_did_not_flag_is_found_in_its_event_log(docker_driver, docker_client):
    # The engine's OOMKilled loses a race with the exit under load; poll then reads the engine's
    # "oom" event for the container. Asked directly here, as the race cannot be forced.
    oom = docker_driver.launch(make_spec(memory_mb=32, command=["sh", "-c", "head -c 200000000 /dev/zero | sort"]))
    killed = docker_driver.launch(make_spec(job_id="killed-1", command=["sleep", "30"]))
    assert wait_done(docker_driver, oom, timeout=60)[1] == 137
    docker_client.api.kill(killed.ref)
    assert wait_done(docker_driver, killed) == (EXITED, 137)
    for handle, logged in ((oom, True), (killed, False)):
        finished = docker_client.api.inspect_container(handle.ref)["State"]["FinishedAt"]
        docker_driver._oom_checked.pop(handle.ref, None)
        assert docker_driver._oom_killed(handle.ref, 137, finished) is logged
    assert docker_driver._oom_killed(oom.ref, 0, None) is False  # only a SIGKILL can be the OOM killer's


def test_stop_sends_sigterm_first(docker_driver):
    h = docker_driver.launch(make_spec(command=[
        "sh", "-c", "trap 'echo got-TERM; exit 0' TERM; echo ready; while :; do sleep 0.1; done"]))
    wait_log(docker_driver, h, b"ready")
    t0 = time.monotonic()
    docker_driver.stop(h, grace_s=10)
    assert time.monotonic() - t0 < 5
    assert wait_done(docker_driver, h) == (EXITED, 0)
    assert b"got-TERM" in docker_driver.read_logs(h, 0)


def test_stop_kills_after_the_grace_period(docker_driver):
    h = docker_driver.launch(make_spec(command=[
        "sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done"]))
    wait_log(docker_driver, h, b"ready")
    t0 = time.monotonic()
    docker_driver.stop(h, grace_s=1.0)
    took = time.monotonic() - t0
    assert 1.0 <= took < 8, took
    assert wait_done(docker_driver, h) == (EXITED, 137)


def test_container_is_hardened(docker_driver, docker_client, node_name):
    spec = make_spec(job_id="hard-1", attempt=3, memory_mb=96, cpus=1.5, pids_limit=77,
                     command=["sh", "-c", "sleep 30"])
    h = docker_driver.launch(spec)
    a = docker_client.api.inspect_container(h.ref)
    hc, cfg = a["HostConfig"], a["Config"]
    assert hc["NetworkMode"] == "none"
    assert hc["CapDrop"] == ["ALL"] and not hc["CapAdd"]
    assert "no-new-privileges" in hc["SecurityOpt"]
    assert not any("unconfined" in o for o in hc["SecurityOpt"])
    assert hc["ReadonlyRootfs"] is True and hc["Privileged"] is False
    assert cfg["User"] == "65534:65534"  # the spec names no project
    assert hc["CgroupnsMode"] == "private"
    assert a["Name"] == f"/gpuportal-{node_name}-hard-1-3"  # the node in the name: engines may be shared
    assert hc["Memory"] == 96 * 1024 * 1024 and hc["MemorySwap"] == hc["Memory"]
    assert hc["PidsLimit"] == 77 and hc["NanoCpus"] == 1_500_000_000
    assert hc["RestartPolicy"]["Name"] in ("", "no")
    # Nothing of the host, least of all docker.sock: only the driver's read-only hosts file (localhost).
    assert not hc["Binds"] and [(m["Destination"], m["RW"]) for m in a["Mounts"]] == [("/etc/hosts", False)]
    assert a["Mounts"][0]["Source"] == str(driver_dir("docker", node_name) / "hosts")
    # No network at all: not the engine's "none" network (its start hook re-runs dockerd), runc's loopback.
    assert cfg["NetworkDisabled"] is True
    assert set(hc["Tmpfs"]) == {"/work", "/tmp"}
    assert not hc.get("DeviceRequests") and not hc["Devices"]
    assert cfg["Labels"] == {"gpuportal.job": "hard-1", "gpuportal.attempt": "3",
                             "gpuportal.node": node_name, "gpuportal.time_limit_s": "60",
                             "gpuportal.gpus": ""}
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_inside_the_container_nothing_is_allowed(docker_driver):
    h = docker_driver.launch(make_spec(command=["sh", "-c", (
        "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; id -u; "
        "touch /rootfs 2>/dev/null && echo ROOT-WRITABLE; "
        "touch /work/f && echo work-ok; ls /sys/class/net")]))
    assert wait_done(docker_driver, h) == (EXITED, 0)
    out = docker_driver.read_logs(h, 0).decode()
    assert "CapEff:\t0000000000000000" in out and "NoNewPrivs:\t1" in out and "Seccomp:\t2" in out
    assert "65534" in out and "ROOT-WRITABLE" not in out and "work-ok" in out
    assert out.split()[-1] == "lo"  # network none: loopback only


def test_a_job_without_network_has_loopback_and_resolves_localhost(docker_driver):
    h = docker_driver.launch(make_spec(command=["sh", "-c", (
        "cat /etc/hosts; ip -o addr show lo; nc -l -p 5005 >/dev/null & "
        "for i in $(seq 100); do echo hi | nc localhost 5005 && { echo loopback-ok; break; }; sleep 0.1; done")]))
    assert wait_done(docker_driver, h) == (EXITED, 0)
    out = docker_driver.read_logs(h, 0).decode()
    assert "127.0.0.1\tlocalhost" in out and "inet 127.0.0.1/8" in out and "loopback-ok" in out


def test_job_env_is_ours_not_the_tenants(docker_driver):
    spec = make_spec(array_index=4, env={"FOO": "bar", "LD_PRELOAD": "/x.so", "CUDA_VISIBLE_DEVICES": "7"},
                     rendezvous={"MASTER_ADDR": "job-1-0", "MASTER_PORT": 29500, "WORLD_SIZE": 2,
                                 "NODE_RANK": 0, "LOCAL_WORLD_SIZE": 1},
                     command=["env"])
    h = docker_driver.launch(spec)
    wait_done(docker_driver, h)
    env = dict(l.split("=", 1) for l in docker_driver.read_logs(h, 0).decode().splitlines() if "=" in l)
    assert env["FOO"] == "bar" and "LD_PRELOAD" not in env and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPUPORTAL_JOB_ID"] == spec.job_id and env["GPUPORTAL_ATTEMPT"] == "1"
    assert env["GPUPORTAL_ARRAY_INDEX"] == "4" and env["MASTER_PORT"] == "29500" and env["WORLD_SIZE"] == "2"


def test_gpu_job_without_nvidia_runtime_fails_clearly(docker_driver, docker_client, node_name):
    if docker_driver.gpu_support():
        pytest.fail("this engine has NVIDIA support; this test is for engines without it", pytrace=False)
    spec = make_spec(gpu_indexes=[0], gpu_uuids=["GPU-00000000-0000-0000-0000-000000000000"])
    with pytest.raises(SandboxError, match="no NVIDIA GPU support"):
        docker_driver.launch(spec)
    # The engine's own refusal gives the same message (and leaves nothing behind).
    docker_driver._gpu_support = True
    with pytest.raises(SandboxError, match="no NVIDIA GPU support.*could not select device driver"):
        docker_driver.launch(spec)
    assert docker_client.containers.list(all=True, filters={"label": [f"gpuportal.node={node_name}"]}) == []
    # CPU jobs still run on the same engine.
    h = docker_driver.launch(make_spec())
    assert wait_done(docker_driver, h) == (EXITED, 0)


def test_simulated_gpus_run_without_the_runtime_with_the_gpu_environment(docker_client, node_name):
    """The demo's node: a GPU job runs in the same hardened container, sees CUDA_VISIBLE_DEVICES and
    the MPS caps as on real GPUs, gets no device, and its log says so first (also read from an offset)."""
    from agents.sandbox.docker_driver import SIMULATED_NOTICE, DockerDriver

    driver = DockerDriver(node=node_name, client=docker_client, simulated_gpus=True)
    try:
        assert driver.gpu_problem() is None
        spec = make_spec(gpu_indexes=[1, 3], gpu_uuids=["GPU-sim-1", "GPU-sim-3"], gpu_fraction=0.5,
                         gpu_memory_mb=4000, command=["env"])
        h = driver.launch(spec)
        assert wait_done(driver, h) == (EXITED, 0)
        logs = driver.read_logs(h, 0)
        assert logs.startswith(SIMULATED_NOTICE) and driver.read_logs(h, 5) == logs[5:]
        env = dict(l.split("=", 1) for l in logs.decode().splitlines()[1:] if "=" in l)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        host = docker_client.containers.get(h.ref).attrs["HostConfig"]
        assert not host.get("DeviceRequests") and host["NetworkMode"] == "none" and host["ReadonlyRootfs"]
        assert host["CapDrop"] == ["ALL"] and host["Memory"] == 64 * 1024 * 1024
        # A CPU job on the same node has no notice: nothing about it is simulated.
        h2 = driver.launch(make_spec())
        assert wait_done(driver, h2) == (EXITED, 0) and driver.read_logs(h2, 0) == b"hello\n"
    finally:
        for c in docker_client.containers.list(all=True, filters={"label": [f"gpuportal.node={node_name}"]}):
            c.remove(force=True)


def test_real_gpus_on_an_engine_without_the_runtime_are_named_unusable(docker_driver):
    if docker_driver.gpu_support():
        pytest.fail("this engine has NVIDIA support; this test is for engines without it", pytrace=False)
    assert docker_driver.gpu_problem() == "Docker engine has no NVIDIA runtime"


def test_gpu_request_names_only_the_allocated_gpus(docker_driver):
    spec = make_spec(gpu_indexes=[2, 5], gpu_uuids=["GPU-a", "GPU-b"], gpu_fraction=0.5, gpu_memory_mb=8000)
    kw = docker_driver._create_kwargs(spec)
    (req,) = kw["device_requests"]
    assert req["Driver"] == "nvidia" and req["DeviceIDs"] == ["GPU-a", "GPU-b"] and req["Capabilities"] == [["gpu"]]
    env = kw["environment"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8000M,1=8000M"


def test_list_own_finds_containers_by_label(docker_driver, docker_client, node_name):
    from agents.sandbox.docker_driver import DockerDriver

    h1 = docker_driver.launch(make_spec(job_id="a", attempt=1, command=["sleep", "30"]))
    h2 = docker_driver.launch(make_spec(job_id="b", attempt=2, command=["true"]))
    other = DockerDriver(node=node_name + "-other", client=docker_client)
    h3 = other.launch(make_spec(job_id="c", command=["true"]))
    try:
        # A restarted agent (a new driver object) sees its own sandboxes only.
        found = DockerDriver(node=node_name, client=docker_client).list_own()
        assert sorted((j, a) for j, a, _ in found) == [("a", 1), ("b", 2)]
        by_job = {j: h for j, _, h in found}
        assert by_job["a"].ref == h1.ref and by_job["a"].time_limit_s == 60
        assert abs(by_job["a"].started_at - h1.started_at) < 5
        assert docker_driver.poll(by_job["a"]) == (RUNNING, None)
    finally:
        other.remove(h3)
    docker_driver.remove(h1)
    docker_driver.remove(h2)
    assert docker_driver.list_own() == []
    assert docker_driver.poll(h1) == (EXITED, None)  # gone: no exit code


def test_same_attempt_cannot_start_twice(docker_driver):
    spec = make_spec(command=["sleep", "30"])
    docker_driver.launch(spec)
    with pytest.raises(SandboxExists):
        docker_driver.launch(spec)


def test_missing_image_is_reported(docker_driver):
    with pytest.raises(SandboxError, match="not present on node"):
        docker_driver.launch(make_spec(image="gpuportal/does-not-exist:1"))


def gang_spec(job_id, rank, *, network=True, command=None):
    return make_spec(job_id=job_id, attempt=2, network=network,
                     command=command or ["sh", "-c", "echo ready; sleep 30"],
                     rendezvous={"MASTER_ADDR": "node-a", "MASTER_PORT": 29517, "WORLD_SIZE": 2,
                                 "NODE_RANK": rank, "LOCAL_WORLD_SIZE": 1})


def test_a_gangs_parts_share_a_job_private_network(docker_client, node_name):
    """Two agents (two drivers, as on two nodes) start the two ranks of one gang. Both join one
    network made for this (job, attempt); rank 1 resolves MASTER_ADDR to rank 0's address on it
    through the engine's DNS (a query to 127.0.0.11 inside the container: no traffic leaves it)."""
    from agents.sandbox.docker_driver import DockerDriver, gang_network_name

    a = DockerDriver(node=node_name + "-a", client=docker_client, gang_network_internal=True)
    b = DockerDriver(node=node_name + "-b", client=docker_client, gang_network_internal=True)
    job = f"gang-{node_name}"
    h0 = a.launch(gang_spec(job, 0))
    h1 = b.launch(gang_spec(job, 1, command=[
        "sh", "-c", 'echo "master=$MASTER_ADDR rank=$NODE_RANK"; nslookup "$MASTER_ADDR"; hostname']))
    try:
        assert wait_done(b, h1) == (EXITED, 0)
        (net,) = [n for n in docker_client.networks.list(names=[gang_network_name(job, 2)])]
        net.reload()
        assert net.attrs["Internal"] is True and net.attrs["Labels"]["gpuportal.job"] == job
        c0 = docker_client.api.inspect_container(h0.ref)
        assert c0["HostConfig"]["NetworkMode"] == net.id
        ep0 = c0["NetworkSettings"]["Networks"][net.name]
        assert "rank0" in ep0["Aliases"]
        out = b.read_logs(h1, 0).decode()
        assert "master=rank0 rank=1" in out
        assert ep0["IPAddress"] and ep0["IPAddress"] in out.split("Name:")[-1], out
        assert out.strip().endswith("rank1")
    finally:
        b.remove(h1)
        # Rank 0 still uses the network: it stays until the last part leaves.
        assert docker_client.networks.list(names=[gang_network_name(job, 2)])
        a.remove(h0)
    assert [n for n in docker_client.networks.list(names=[gang_network_name(job, 2)])] == []


def test_auto_picks_a_bridge_on_an_engine_in_no_swarm(docker_driver, docker_client):
    assert docker_client.info()["Swarm"]["LocalNodeState"] != "active"  # this machine's engine
    assert docker_driver.gang_network_driver == "bridge"


def test_without_network_a_gang_part_stays_on_network_none(docker_driver, docker_client):
    h = docker_driver.launch(gang_spec("gang-none", 0, network=False, command=["true"]))
    assert docker_client.api.inspect_container(h.ref)["HostConfig"]["NetworkMode"] == "none"
    assert docker_client.networks.list(names=["gpuportal-job-gang-none-2"]) == []


def test_empty_gang_networks_left_by_a_crash_are_pruned(docker_driver, docker_client):
    from agents.sandbox.docker_driver import LABEL_NETWORK

    stale = docker_client.networks.create("gpuportal-job-crashed-1", internal=True,
                                          labels={LABEL_NETWORK: "gang", "gpuportal.job": "crashed"})
    try:
        docker_driver._prune_gang_networks()
        stale.reload()  # a minute old at most: it may be a rank's fresh network, kept
        docker_driver._prune_gang_networks(keep_younger_than_s=0)
        with pytest.raises(docker.errors.NotFound):
            stale.reload()
    finally:
        try:
            stale.remove()
        except docker.errors.NotFound:
            pass


def test_gang_network_options_come_from_flags_or_environment(monkeypatch):
    from agents.__main__ import parse_args

    base = ["--portal", "http://p", "--token", "gpn_x", "--broker", "redis://b"]
    args = parse_args(base)
    assert args.gang_network_driver == "auto" and args.gang_network_internal is False
    monkeypatch.setenv("GPUPORTAL_GANG_NETWORK_DRIVER", "overlay")
    monkeypatch.setenv("GPUPORTAL_GANG_NETWORK_INTERNAL", "1")
    args = parse_args(base)
    assert args.gang_network_driver == "overlay" and args.gang_network_internal is True
    with pytest.raises(SystemExit):
        parse_args(base + ["--gang-network-driver", "host"])
    assert parse_args(base).gpu_scrub == "on" and parse_args(base + ["--gpu-scrub", "off"]).gpu_scrub == "off"
    monkeypatch.setenv("GPUPORTAL_GPU_SCRUB", "maybe")
    with pytest.raises(SystemExit):
        parse_args(base)


# -- egress of jobs with network ----------------------------------------------------

@pytest.fixture
def egress_driver(docker_client, node_name):
    """Drivers whose jobs with network join a job network of their own (bridge gpj<hash> on the node).
    The egress chain is the node's, shared by its drivers: removed at the end."""
    from agents.sandbox.docker_driver import DockerDriver

    made = []

    def make(**kw):
        d = DockerDriver(node=node_name, client=docker_client, job_network=f"gpuportal-jobs-{node_name}", **kw)
        made.append(d)
        return d
    yield make
    for c in docker_client.containers.list(all=True, filters={"label": [f"gpuportal.node={node_name}"]}):
        c.remove(force=True)
    for d in made:
        for net in docker_client.networks.list(names=[d.job_network]):
            net.remove()
    if made:
        made[0].firewall.remove()


def test_a_job_with_network_cannot_reach_the_nodes_own_services(egress_driver, docker_client, node_services):
    """The bridge's gateway is the node: without the policy a job reaches whatever listens on any of the
    node's addresses (a database on 0.0.0.0). Its own 127.0.0.1 is the container's, not the node's."""
    from agents.sandbox.docker_driver import bridge_name

    d, (node_ip, (lo_port, ip_port, _)) = egress_driver(), node_services
    h = d.launch(make_spec(network=True, command=probe_command([("127.0.0.1", lo_port), (node_ip, ip_port)])))
    assert wait_done(d, h, timeout=60) == (EXITED, 0)
    out = d.read_logs(h, 0).decode()
    assert probe_lines(out) == [f"127.0.0.1:{lo_port}=", f"{node_ip}:{ip_port}="], out
    (net,) = docker_client.networks.list(names=[d.job_network])
    assert net.attrs["Options"]["com.docker.network.bridge.name"] == bridge_name(d.job_network)
    assert net.attrs["Options"]["com.docker.network.bridge.enable_icc"] == "false"
    assert docker_client.containers.get(h.ref).attrs["HostConfig"]["NetworkMode"] == d.job_network


def test_an_operator_can_allow_a_destination_to_docker_jobs(egress_driver, node_services):
    node_ip, (lo_port, ip_port, _) = node_services
    d = egress_driver(egress_allow=node_ip)
    h = d.launch(make_spec(network=True, command=probe_command([("127.0.0.1", lo_port), (node_ip, ip_port)])))
    assert wait_done(d, h, timeout=60) == (EXITED, 0)
    out = d.read_logs(h, 0).decode()
    assert probe_lines(out) == [f"127.0.0.1:{lo_port}=", f"{node_ip}:{ip_port}=secret-{ip_port}"], out


def test_a_docker_job_with_network_is_refused_where_the_policy_cannot_be_enforced(egress_driver, monkeypatch):
    d = egress_driver()
    monkeypatch.setenv("PATH", "/nonexistent")  # no iptables
    with pytest.raises(SandboxError, match=f"jobs with network cannot run on node {d.node}: its egress policy "
                                           "cannot be enforced"):
        d.launch(make_spec(network=True))
    assert d.list_own() == []


# -- per-project uids, private cgroups, names per installation ---------------------------

def test_each_project_runs_under_a_uid_of_its_own(docker_client, node_name):
    from agents.sandbox.docker_driver import DockerDriver

    d = DockerDriver(node=node_name, client=docker_client, job_uids="2000000-2000099")
    cmd = ["sh", "-c", "id -u; id -g; touch /work/f && stat -c %u /work/f; cat /proc/self/cgroup"]
    outs = {}
    for project in (1, 2, None):
        h = d.launch(make_spec(project_id=project, command=cmd))
        assert wait_done(d, h) == (EXITED, 0)
        outs[project] = d.read_logs(h, 0).decode().split("\n")
        d.remove(h)
    assert outs[1][:3] == ["2000001"] * 3 and outs[2][:3] == ["2000002"] * 3
    assert outs[None][:3] == ["65534"] * 3  # an older portal's launch, without its project
    # A private cgroup namespace: the job sees its own cgroup as the root, not the host's tree.
    cgroups = [line for line in outs[1][3:] if line]
    assert cgroups and all(line.endswith(":/") for line in cgroups), cgroups
    with pytest.raises(SandboxError, match=f"project 100 has no uid in node {node_name}'s range 2000000-2000099"):
        d.launch(make_spec(project_id=100))


def test_agents_of_two_installations_on_one_engine_keep_apart(docker_client, node_name):
    """Same node name, same job attempt, two installations: both start, each adopts only its own."""
    from agents.sandbox.docker_driver import DockerDriver

    a = DockerDriver(node=node_name, client=docker_client, installation="prod")
    b = DockerDriver(node=node_name, client=docker_client, installation="staging")
    spec = make_spec(command=["sleep", "30"])
    ha, hb = a.launch(spec), b.launch(spec)
    try:
        assert docker_client.containers.get(ha.ref).name == f"gpuportal-prod-{node_name}-{spec.job_id}-1"
        assert [h.ref for _, _, h in a.list_own()] == [ha.ref]
        assert [h.ref for _, _, h in b.list_own()] == [hb.ref]
        assert DockerDriver(node=node_name, client=docker_client).list_own() == []  # no installation: neither
    finally:
        a.remove(ha)
        b.remove(hb)
