"""KVM sandbox, for real: libvirtd on qemu:///system boots the project's guest
(agents/sandbox/kvm_image.py) with the job's image from the local Docker engine,
and runs the job's command in it.

No skips: without libvirtd, QEMU, the guest image or the Docker engine these
tests FAIL and point at .ci/kvm.sh or .ci/docker.sh, which install and start
all of it. On machines where KVM does not work (PVM here) the driver falls back
to the 'qemu' domain type (TCG), a few seconds per boot.
"""

import io
import os
import re
import shutil
import tarfile
import tempfile
import time
import uuid

import pytest

from agents.sandbox import EXITED, RUNNING, SandboxError
from agents.sandbox.volumes import prepare_dir
from tests.agents.conftest import make_spec
from tests.agents.node_services import node_services, probe_command, probe_lines  # noqa: F401

URI = "qemu:///system"
SETUP = "run .ci/kvm.sh (installs QEMU, libvirtd and busybox-static, starts libvirtd, builds var/kvm)"


@pytest.fixture(scope="session")
def kvm_image():
    """The guest image, built once (and cached in var/kvm across sessions)."""
    if not shutil.which("qemu-system-x86_64"):
        pytest.fail(f"qemu-system-x86_64 is not installed; {SETUP}", pytrace=False)
    from agents.sandbox import kvm_image

    try:
        return kvm_image.build()
    except (kvm_image.ImageError, OSError) as exc:
        pytest.fail(f"cannot build the KVM guest image ({exc}); {SETUP}", pytrace=False)


def make_vm_driver(kvm_image, **kw):
    """A driver on qemu:///system with a node name, state folder and VM uid range of its own (its egress
    chain is named after the range); ``close_vm_driver`` undoes all of it."""
    try:
        import libvirt
    except ImportError:
        pytest.fail(f"libvirt-python is not installed; {SETUP}", pytrace=False)
    from agents.sandbox import SandboxError
    from agents.sandbox.kvm_driver import KvmDriver

    try:
        libvirt.open(URI).close()
    except libvirt.libvirtError as exc:
        pytest.fail(f"libvirtd is not answering on {URI} ({exc}); {SETUP}", pytrace=False)
    node = f"kvmtest-{uuid.uuid4().hex[:8]}"
    # Not pytest's tmp_path: its 0700 parents keep QEMU's user out (the driver warns about that).
    state_dir = tempfile.mkdtemp(prefix=f"gpuportal-{node}-")
    os.chmod(state_dir, 0o711)
    first = 3_000_000 + int(uuid.uuid4().int % 800) * 1000
    kw.setdefault("vm_uids", f"{first}-{first + 999}")
    try:
        return KvmDriver(node=node, uri=URI, kernel=kvm_image.kernel, initrd=kvm_image.initrd,
                         state_dir=state_dir, **kw)
    except SandboxError as exc:
        shutil.rmtree(state_dir, ignore_errors=True)
        pytest.fail(f"{exc}; {SETUP}", pytrace=False)


def close_vm_driver(d):
    for _, _, h in d.list_own():  # nothing of ours may outlive the tests
        d.remove(h)
    d.firewall.remove()
    d.conn.close()
    shutil.rmtree(d.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def vm_driver(kvm_image, docker_client):  # the job images come from the engine
    d = make_vm_driver(kvm_image)
    yield d
    close_vm_driver(d)


def wait_exit(d, h, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, rc = d.poll(h)
        if state != RUNNING:
            return state, rc
        time.sleep(0.1)
    d.remove(h)
    pytest.fail(f"VM {h.ref} still running after {timeout}s; console:\n{d._console(h)[-2000:]!r}")


def wait_output(d, h, want: bytes, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = d.read_logs(h, 0)
        if want in out:
            return out
        time.sleep(0.1)
    d.remove(h)
    pytest.fail(f"VM {h.ref} printed no {want!r} in {timeout}s; console:\n{d._console(h)[-2000:]!r}")


def test_a_real_vm_runs_echo_hello(vm_driver):
    from agents.sandbox.kvm_domain import kvm_works

    d = vm_driver
    assert d.domain_type == ("kvm" if kvm_works(d.conn)[0] else "qemu")
    h = d.launch(make_spec(command=["echo", "hello"]))
    assert wait_exit(d, h) == (EXITED, 0)
    assert d.read_logs(h, 0) == b"hello\n"  # only the job's bytes, none of the kernel's
    console = d._console(h)
    assert b"hello\n" in console and console != b"hello\n"
    assert d.read_logs(h, 3) == b"lo\n"
    d.remove(h)
    assert d.read_logs(h, 0) == b"" and d.list_own() == []


def test_exit_code_argv_and_env_reach_the_guest(vm_driver):
    d = vm_driver
    spec = make_spec(command=["sh", "-c", 'printf "%s|%s|%s\\n" "$FOO" "$1" "$GPUPORTAL_JOB_ID"; exit 3',
                              "argv0", "a b'c \"d\""],
                     env={"FOO": "bar $baz", "LD_PRELOAD": "/evil.so"}, memory_mb=256, cpus=2)
    h = d.launch(spec)
    xml = d.conn.lookupByName(h.ref).XMLDesc()
    assert "<interface" not in xml and "<hostdev" not in xml and ">2</vcpu>" in xml
    # The job's 256 MiB, the guest's own 96 and room for the busybox image (2 MiB) and the initrd, held in RAM.
    assert (256 + 96) * 1024 < int(re.search(r"<memory unit='KiB'>(\d+)<", xml).group(1)) <= (256 + 96 + 16) * 1024
    assert wait_exit(d, h) == (EXITED, 3)
    assert d.read_logs(h, 0) == f"bar $baz|a b'c \"d\"|{spec.job_id}\n".encode()
    d.remove(h)


def test_a_job_cannot_fake_its_exit_code(vm_driver):
    """The job exits 3 while a child of its keeps printing the console's exit marker with 0 (so the last
    marker there would be the job's): the code comes from the second serial port, which it cannot open."""
    d = vm_driver
    h = d.launch(make_spec(command=["sh", "-c", '{ echo "GPUPORTAL-JOB-EXIT rc=0 oom_kill=0" > /dev/ttyS1; } '
                                                '2>/dev/null || echo "ttyS1 refused"; '
                                                '(while :; do echo "GPUPORTAL-JOB-EXIT rc=0"; done) & sleep 1; exit 3']))
    assert wait_exit(d, h) == (EXITED, 3)
    out = d.read_logs(h, 0)
    assert out.startswith(b"ttyS1 refused\nGPUPORTAL-JOB-EXIT rc=0\n"), out[:200]
    d.remove(h)


def test_the_job_gets_its_memory_not_the_images_and_over_it_ends_oom(vm_driver):
    """40 MiB of files in /work fit a 64 MiB job; an endless allocation is killed at 64 MiB, although the VM
    holds more (the guest's share, the image): reported oom, as docker reports it."""
    from agents.sandbox import OOM

    d = vm_driver
    h = d.launch(make_spec(memory_mb=64, command=[
        "sh", "-c", "dd if=/dev/zero of=/work/a bs=1M count=40 2>/dev/null && echo fits; rm /work/a; "
                    "exec tail /dev/zero"]))
    assert wait_exit(d, h) == (OOM, 137)
    assert d.read_logs(h, 0) == b"fits\n"
    d.remove(h)


def test_cpus_are_capped_on_the_host_and_more_than_the_node_has_are_refused(vm_driver):
    d = vm_driver
    node_cpus = d.conn.getInfo()[2]
    with pytest.raises(SandboxError, match=f"cpus: {node_cpus + 1} needs {node_cpus + 1} vCPUs, node {d.node} "
                                           f"has {node_cpus} CPUs"):
        d.launch(make_spec(cpus=node_cpus + 1))
    h = d.launch(make_spec(cpus=0.25, command=["sh", "-c", "echo up; sleep 600"]))
    wait_output(d, h, b"up\n")
    dom = d.conn.lookupByName(h.ref)
    params = dom.schedulerParameters()  # read back from the domain's cgroup
    assert (dom.maxVcpus(), params["global_period"], params["global_quota"]) == (1, 100000, 25000)
    d.remove(h)


def test_output_over_virtlogds_rotation_size_comes_back_whole_and_the_files_go(vm_driver):
    """virtlogd rotates a console at 2 MiB: the job's first bytes (its start marker with them) moved to
    <console>.0 and the agent read only the rest. About 2.2 MiB of output, at the guest serial port's
    speed under TCG (about 70 KiB/s here): this test takes some 40 s."""
    d = vm_driver
    h = d.launch(make_spec(command=["seq", "1", "330000"], time_limit_s=600))
    assert wait_exit(d, h, timeout=300) == (EXITED, 0)
    out = d.read_logs(h, 0)
    assert len(out) > 2 * 2**20 and out == "".join(f"{i}\n" for i in range(1, 330001)).encode()
    assert sorted(p.name.removeprefix(h.ref) for p in d.state_dir.iterdir() if p.name.startswith(h.ref)) == [
        ".exit", ".json", ".log", ".log.0", ".log.archive", ".log.archived"]
    d.remove(h)
    assert [p.name for p in d.state_dir.iterdir() if p.name.startswith(h.ref)] == []


@pytest.fixture(scope="module")
def marker_image(vm_driver, docker_client):
    """A second image, imported as .ci/docker.sh imports the job image (busybox-static), with a marker file, an
    entrypoint, its own PATH and no /bin/sh: the guest must run the command in it without the image's shell."""
    client = docker_client
    marker = f"gpuportal-marker-{uuid.uuid4().hex}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add("/bin/busybox", arcname="bin/busybox")
        for applet in ("cat", "id", "pwd"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tf.addfile(link)
        f = tarfile.TarInfo("etc/gpuportal-marker")
        f.size = len(marker) + 1
        tf.addfile(f, io.BytesIO(marker.encode() + b"\n"))
    tag = f"gpuportal/kvm-marker:{marker[-12:]}"
    client.api.import_image_from_data(buf.getvalue(), repository=tag.split(":")[0], tag=tag.split(":")[1],
                                      changes=["ENV PATH=/opt/none:/bin GREETING=from-image",
                                               'ENTRYPOINT ["/bin/busybox"]'])
    image_id = client.images.get(tag).id
    yield tag, marker
    client.images.remove(image_id, force=True)
    (vm_driver.image_cache / f"{image_id.split(':')[-1]}.cpio.gz").unlink(missing_ok=True)


def test_the_job_runs_in_its_image_as_nobody(vm_driver, marker_image):
    d, (image, marker) = vm_driver, marker_image
    # Entrypoint first, as in Docker: the guest execs `/bin/busybox sh -c ...` inside the image.
    h = d.launch(make_spec(image=image, command=[
        "sh", "-c", 'cat /etc/gpuportal-marker; id -u; id -g; pwd; echo "$PATH $GREETING"; '
                    '[ -e /bin/sh ] || echo "no /bin/sh"']))
    assert wait_exit(d, h) == (EXITED, 0)
    assert d.read_logs(h, 0).decode() == f"{marker}\n65534\n65534\n/work\n/opt/none:/bin from-image\nno /bin/sh\n"
    d.remove(h)


def test_network_gives_a_nic_with_an_address_and_no_network_only_loopback(vm_driver):
    # QEMU's user-mode network answers DHCP inside QEMU itself: no packet leaves the host for this.
    d = vm_driver
    cmd = ["sh", "-c", "ls /sys/class/net; ip -4 addr show; cat /etc/resolv.conf 2>/dev/null; true"]
    online, offline = d.launch(make_spec(network=True, command=cmd)), d.launch(make_spec(command=cmd))
    assert wait_exit(d, online) == (EXITED, 0) and wait_exit(d, offline) == (EXITED, 0)
    out = d.read_logs(online, 0).decode()
    assert out.split()[:2] == ["eth0", "lo"] and "inet 10.0.2.15/24" in out and "nameserver 10.0.2.3" in out, out
    out = d.read_logs(offline, 0).decode()
    assert out.split()[0] == "lo" and "eth0" not in out and "inet 127.0.0.1/8" in out, out
    d.remove(online)
    d.remove(offline)


def test_a_job_with_network_cannot_reach_the_nodes_own_services(vm_driver, node_services):
    """QEMU's user-mode network makes the guest's 10.0.2.2 the node's 127.0.0.1: without the egress
    policy the job reads from the node's loopback services and its own address (issue: a job logged
    into the node's PostgreSQL). Nothing here leaves the node: every target is one of its addresses."""
    d, (node_ip, (lo_port, ip_port, v6_port)) = vm_driver, node_services
    # fec0::2 is the node's ::1 the same way (the guest has its IPv6 address a few seconds after boot).
    cmd = probe_command([("10.0.2.2", lo_port), (node_ip, ip_port), ("fec0::2", v6_port)])
    cmd[-1] = "sleep 4; " + cmd[-1]
    h = d.launch(make_spec(network=True, command=cmd))
    assert wait_exit(d, h) == (EXITED, 0)
    out = d.read_logs(h, 0).decode()
    assert probe_lines(out) == [f"10.0.2.2:{lo_port}=", f"{node_ip}:{ip_port}=", f"fec0::2:{v6_port}="], out
    d.remove(h)


def test_an_operator_can_allow_a_destination(kvm_image, docker_client, node_services):
    """--egress-allow opens one destination: the node's address answers, its loopback still does not."""
    node_ip, (lo_port, ip_port, _) = node_services
    d = make_vm_driver(kvm_image, egress_allow=f"{node_ip}/32")
    try:
        h = d.launch(make_spec(network=True, command=probe_command([("10.0.2.2", lo_port), (node_ip, ip_port)])))
        assert wait_exit(d, h) == (EXITED, 0)
        out = d.read_logs(h, 0).decode()
        assert probe_lines(out) == [f"10.0.2.2:{lo_port}=", f"{node_ip}:{ip_port}=secret-{ip_port}"], out
    finally:
        close_vm_driver(d)


def test_a_job_with_network_is_refused_where_the_policy_cannot_be_enforced(kvm_image, docker_client,
                                                                          monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no iptables
    d = make_vm_driver(kvm_image)
    try:
        with pytest.raises(SandboxError, match=f"jobs with network cannot run on node {d.node}: its egress "
                                               "policy cannot be enforced"):
            d.launch(make_spec(network=True))
        assert d.list_own() == []
    finally:
        close_vm_driver(d)


def test_a_missing_image_fails_with_a_message_for_its_owner(vm_driver):
    image = "gpuportal/no-such-image:0"
    with pytest.raises(SandboxError, match=f"image '{image}' is not present on node {vm_driver.node}"):
        vm_driver.launch(make_spec(image=image))
    assert vm_driver.list_own() == []


def test_stop_destroys_a_vm_whose_job_ignores_sigterm_and_list_own_finds_it(vm_driver):
    d = vm_driver
    spec = make_spec(command=["sh", "-c", "trap '' TERM; echo up; while :; do sleep 1; done"])
    h = d.launch(spec)
    wait_output(d, h, b"up\n")
    ((job, attempt, found),) = d.list_own()
    assert (job, attempt, found.ref, found.time_limit_s) == (spec.job_id, 1, h.ref, 60)
    assert abs(found.started_at - h.started_at) < 0.01
    assert d.poll(h) == (RUNNING, None)
    t0 = time.monotonic()
    d.stop(h, grace_s=1.0)
    assert time.monotonic() - t0 < 20
    with pytest.raises(Exception, match="[Dd]omain not found"):
        d.conn.lookupByName(h.ref)  # destroyed: a transient domain is gone
    assert d.poll(h) == (EXITED, None)  # no exit marker: it was killed
    assert d.read_logs(h, 0) == b"up\n"
    # Its record stays until removed: an agent restarted now would still find it and report it.
    assert [found.ref for _, _, found in d.list_own()] == [h.ref]
    d.remove(h)
    assert d.list_own() == []


def test_stop_presses_the_power_button_and_the_job_gets_sigterm(vm_driver):
    d = vm_driver
    h = d.launch(make_spec(command=["sh", "-c", "echo up; exec sleep 600"]))
    wait_output(d, h, b"up\n")
    t0 = time.monotonic()
    d.stop(h, grace_s=30)
    assert time.monotonic() - t0 < 25, "the guest did not act on the ACPI power button"
    assert d.poll(h) == (EXITED, 143)  # 128 + SIGTERM, as in the docker sandbox
    d.remove(h)


@pytest.mark.parametrize("domain_type,gpus,network", [("qemu", 0, False), ("kvm", 2, False), ("qemu", 1, True)])
def test_domain_xml_validates_against_libvirts_schema(tmp_path, domain_type, gpus, network):
    import subprocess

    from agents.sandbox.kvm_domain import domain_xml

    if not shutil.which("virt-xml-validate") or not shutil.which("xmllint"):
        pytest.fail(f"virt-xml-validate or xmllint is missing; {SETUP}", pytrace=False)
    spec = make_spec(gpu_indexes=list(range(gpus)), gpu_uuids=[f"GPU-{i}" for i in range(gpus)], network=network)
    buses = [f"{0x10000 * i:04x}:{0x18 + 16 * i:02x}:00.0" for i in range(gpus)]  # the second behind VMD
    xml = domain_xml(spec, node="n1", pci_bus_ids=buses,
                     kernel="/k", initrd="/i", console_log="/tmp/c.log", domain_type=domain_type,
                     job_network="user", filesystems=[("/d/imagenet", "ds0", True), ("/o/outputs", "outputs", False),
                                  ("/v/scratch", "vol0", False, "passthrough")])
    assert ("<interface" in xml) == network and xml.count("<hostdev ") == gpus
    assert xml.count('<filesystem type="mount" accessmode="squash">') == 1 and "<readonly />" in xml
    assert xml.count('<filesystem type="mount" accessmode="mapped">') == 1
    assert xml.count('<filesystem type="mount" accessmode="passthrough">') == 1
    (tmp_path / "d.xml").write_text(xml)
    r = subprocess.run(["virt-xml-validate", str(tmp_path / "d.xml"), "domain"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_terminal_session_is_a_shell_in_the_vm_as_the_job(vm_driver):
    """The guest serves the job's terminal on its third serial port; the session gateway reaches it
    through the port's unix socket on the host: the shell runs in the job's image as uid 65534."""
    import json

    from websockets.sync.client import connect

    from agents.sessions import SECRET_HEADER, Gateway, SessionDriver

    gateway = Gateway(listen="127.0.0.1:0").start()
    secret = "kvm-terminal-key-0123456789"
    spec = make_spec(command=["sleep", "300"], time_limit_s=400, sessions=[
        {"name": "sh", "kind": "terminal", "port": None, "secret": secret, "base_url": "/sessions/1/sh/"}])
    driver = SessionDriver(vm_driver, gateway)
    h = driver.launch(spec)
    seen = b""
    try:
        url = gateway.url.replace("http://", "ws://") + f"/sessions/{spec.job_id}/sh/ws"
        with connect(url, additional_headers={SECRET_HEADER: secret}, open_timeout=30) as ws:
            deadline, sent = time.monotonic() + 120, 0.0
            while b"kvm-42 " not in seen and time.monotonic() < deadline:
                if time.monotonic() - sent > 3:  # until the guest has booted and serves the shell
                    ws.send(json.dumps({"type": "input", "data": "echo kvm-$((6*7)) $(id -u) $HOME\n"}))
                    sent = time.monotonic()
                try:
                    seen += ws.recv(timeout=1)
                except TimeoutError:
                    pass
            while b"\n" not in seen[seen.find(b"kvm-42 "):] and time.monotonic() < deadline:
                seen += ws.recv(timeout=10)
        assert vm_driver.poll(h)[0] == RUNNING
    finally:
        driver.remove(h)
        gateway.stop()
    assert b"kvm-42 " in seen, f"no answer from the VM's shell: {seen[-2000:]!r}; console: {vm_driver._console(h)[-2000:]!r}"
    line = seen[seen.index(b"kvm-42 "):].split(b"\n")[0].decode().strip()
    assert line.split() == ["kvm-42", "65534", "/work"], line
    assert not os.path.exists(vm_driver._terminal_path(h.ref).parent)  # its socket goes with the VM


def test_datasets_are_read_only_and_outputs_come_back_through_virtio_9p(vm_driver):
    """Over virtio-9p: a dataset folder of the node's cache (files 0444, folders 0555) at
    /datasets/<name>, read-only even for the guest's root; /outputs writable by the job (nobody), its
    files in the host folder ``outputs_dir`` once the VM is gone, a symlink the job made a plain file
    there holding the target's name (nothing to follow); the folder goes with the sandbox."""
    d = vm_driver
    data = tempfile.mkdtemp(prefix="gpuportal-dataset-")
    os.makedirs(f"{data}/train")
    with open(f"{data}/train/a.txt", "w") as f:
        f.write("hello dataset\n")
    for p, mode in ((f"{data}/train/a.txt", 0o444), (f"{data}/train", 0o555), (data, 0o555)):
        os.chmod(p, mode)
    try:
        script = ("cat /datasets/tiny/train/a.txt; (echo x > /datasets/tiny/new) 2>/dev/null && echo writable"
                  " || echo read-only; echo result > /outputs/r.txt && mkdir /outputs/sub"
                  " && echo deep > /outputs/sub/d.txt && ln -s /etc/passwd /outputs/link; id -u; echo $GPUPORTAL_OUTPUTS_DIR")
        h = d.launch(make_spec(command=["sh", "-c", script], dataset_paths={"tiny": data}, outputs=True))
        assert wait_exit(d, h) == (EXITED, 0), d._console(h)[-3000:]
        assert d.read_logs(h, 0) == b"hello dataset\nread-only\n65534\n/outputs\n", d.read_logs(h, 0)
        out = d.outputs_dir(h)
        assert open(f"{out}/r.txt").read() == "result\n" and open(f"{out}/sub/d.txt").read() == "deep\n"
        assert not os.path.islink(f"{out}/link") and open(f"{out}/link").read() == "/etc/passwd"
        assert sorted(os.listdir(data)) == ["train"]
        d.remove(h)
        assert d.outputs_dir(h) is None and not os.path.exists(out)
    finally:
        for folder, _, _ in os.walk(data):
            os.chmod(folder, 0o755)
        shutil.rmtree(data)


def test_project_volumes_and_checkpoints_are_the_projects_on_the_node(kvm_image, docker_client, node_services):
    """A VM that mounts its project's volumes runs QEMU as the project's uid/gid and shares them over
    virtio-9p in passthrough mode: what the job writes at /data/<volume> and in
    GPUPORTAL_CHECKPOINT_DIR belongs on the node to the project's uid/gid, as from the docker sandbox;
    a read-only volume stays unchanged; a link planted in the volume that points out of it is
    resolved in the guest, never on the node; and the next attempt finds the checkpoint. With network,
    such a VM (its QEMU a project's uid, not a VM uid) is still held to the egress policy."""
    root = tempfile.mkdtemp(prefix="gpuportal-volumes-")
    os.chmod(root, 0o755)
    outside = tempfile.mkdtemp(prefix="gpuportal-outside-")
    first = 2_100_000 + int(uuid.uuid4().int % 800) * 1000
    d = make_vm_driver(kvm_image, volumes_root=root, job_uids=f"{first}-{first + 999}")
    project, uid = 7, first + 7
    volumes = [{"name": "scratch", "read_only": False, "path": "org/proj/scratch"},
               {"name": "ref", "read_only": True, "path": "org/proj/ref"}]
    checkpoint = {"volume": "scratch", "path": "org/proj/scratch/.checkpoints/42"}
    try:
        for v in volumes:  # as the portal makes a volume: the project's folders
            prepare_dir(root, v["path"], owner=uid)
        with open(f"{root}/org/proj/ref/in.txt", "w") as f:
            f.write("reference\n")
        os.symlink(outside, f"{root}/org/proj/scratch/out")  # planted: must not lead the guest out
        script = ("id -u; cat /data/ref/in.txt; (echo x > /data/ref/new) 2>/dev/null && echo writable || echo read-only;"
                  " mkdir /data/scratch/run && echo result > /data/scratch/run/r.txt;"
                  " (mkdir -p /data/scratch/out/d; echo esc > /data/scratch/out/x) 2>/dev/null;"
                  " echo step-1 > $GPUPORTAL_CHECKPOINT_DIR/last; echo $GPUPORTAL_CHECKPOINT_DIR")
        spec = make_spec(command=["sh", "-c", script], project_id=project, volumes=volumes, checkpoint=checkpoint)
        h = d.launch(spec)
        assert wait_exit(d, h) == (EXITED, 0), d._console(h)[-3000:]
        assert d.read_logs(h, 0) == f"{uid}\nreference\nread-only\n/data/scratch/.checkpoints/42\n".encode(), \
            d.read_logs(h, 0)
        d.remove(h)
        scratch = f"{root}/org/proj/scratch"
        for p in (f"{scratch}/run", f"{scratch}/run/r.txt", f"{scratch}/.checkpoints/42/last"):
            st = os.lstat(p)
            assert (st.st_uid, st.st_gid) == (uid, uid), (p, st.st_uid, st.st_gid)
        assert open(f"{scratch}/run/r.txt").read() == "result\n"
        assert sorted(os.listdir(f"{root}/org/proj/ref")) == ["in.txt"] and os.listdir(outside) == []
        # The next attempt (a requeue, on any node) finds the checkpoint where it left it.
        node_ip, (lo_port, ip_port, _) = node_services
        cmd = probe_command([("10.0.2.2", lo_port), (node_ip, ip_port)])
        cmd[-1] = "cat $GPUPORTAL_CHECKPOINT_DIR/last; " + cmd[-1]
        again = make_spec(job_id=spec.job_id, attempt=2, command=cmd, network=True,
                          project_id=project, volumes=volumes, checkpoint=checkpoint)
        h = d.launch(again)
        assert wait_exit(d, h) == (EXITED, 0), d._console(h)[-3000:]
        out = d.read_logs(h, 0).decode()
        assert out.startswith("step-1\n") and probe_lines(out) == [f"10.0.2.2:{lo_port}=", f"{node_ip}:{ip_port}="], out
    finally:
        close_vm_driver(d)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)


def test_volumes_behind_a_folder_qemu_cannot_pass_are_refused_with_the_fix(kvm_image, docker_client):
    """QEMU opens a volume as the project's uid: a volumes root below a 0700 folder is refused at launch,
    naming the folder, and no VM starts."""
    closed = tempfile.mkdtemp(prefix="gpuportal-closed-")  # 0700
    d = make_vm_driver(kvm_image, volumes_root=f"{closed}/volumes")
    try:
        with pytest.raises(SandboxError, match=f"{closed} is not searchable by other users"):
            d.launch(make_spec(project_id=3, volumes=[{"name": "x", "read_only": False, "path": "o/p/x"}]))
        assert d.list_own() == []
    finally:
        close_vm_driver(d)
        shutil.rmtree(closed)
