"""KVM sandbox: domain XML and the image's tar-to-cpio conversion always;
lifecycle against libvirt's test driver (test:///default, no daemon) when
libvirt-python is installed; image errors against the real Docker engine."""

import io
import json
import stat
import tarfile
import xml.etree.ElementTree as ET

import pytest

from agents.sandbox import EXITED, OOM, RUNNING, SandboxError
from agents.sandbox.kvm_domain import METADATA_NS, domain_xml, pci_address
from agents.sandbox.kvm_image import BUILD_VERSION, ImageError, image_cpio
from tests.agents.conftest import make_spec


def test_pci_address_from_nvml_bus_id():
    assert pci_address("00000000:3B:00.0") == {"domain": "0x0000", "bus": "0x3b", "slot": "0x00", "function": "0x0"}
    assert pci_address("0001:af:1f.7") == {"domain": "0x0001", "bus": "0xaf", "slot": "0x1f", "function": "0x7"}
    # A VMD domain keeps its upper bits (it was cut to 0x0000, a different device).
    assert pci_address("00010000:e1:00.0")["domain"] == "0x10000"
    with pytest.raises(SandboxError):
        pci_address("GPU-abc")


def fake_pci(root, name, vendor, klass):
    (root / name).mkdir(parents=True)
    (root / name / "vendor").write_text(vendor + "\n")
    (root / name / "class").write_text(klass + "\n")


def test_only_an_nvidia_display_controller_is_passed_through(tmp_path):
    from agents.sandbox.kvm_domain import check_gpu

    fake_pci(tmp_path, "0000:3b:00.0", "0x10de", "0x030200")  # a data-centre GPU (3D controller)
    fake_pci(tmp_path, "10000:e1:00.0", "0x10de", "0x030000")  # behind VMD
    fake_pci(tmp_path, "0000:18:00.0", "0x15b3", "0x020000")  # a NIC where a GPU was expected
    fake_pci(tmp_path, "0000:28:00.0", "0x10de", "0x040300")  # the GPU's audio function
    check_gpu("00000000:3B:00.0", sysfs=str(tmp_path))
    check_gpu("00010000:E1:00.0", sysfs=str(tmp_path))
    with pytest.raises(SandboxError, match=r"PCI device 0000:18:00.0 is not an NVIDIA GPU \(vendor 0x15b3"):
        check_gpu("00000000:18:00.0", sysfs=str(tmp_path))
    with pytest.raises(SandboxError, match="0000:28:00.0 is not an NVIDIA GPU"):
        check_gpu("0000:28:00.0", sysfs=str(tmp_path))
    with pytest.raises(SandboxError, match="no PCI device 0000:99:00.0 on this host"):
        check_gpu("0000:99:00.0", sysfs=str(tmp_path))


def test_this_hosts_own_pci_devices_are_no_gpus():
    """The real sysfs: a simulated GPU's default address on a real server is some other device."""
    import os

    from agents.sandbox.kvm_domain import check_gpu

    name = sorted(os.listdir("/sys/bus/pci/devices"))[0]
    with pytest.raises(SandboxError, match=f"PCI device {name} is not an NVIDIA GPU"):
        check_gpu(name)


def test_domain_xml_passes_only_the_allocated_gpus_and_no_nic():
    spec = make_spec(job_id="j1", attempt=2, gpu_indexes=[1, 3], gpu_uuids=["GPU-a", "GPU-b"], cpus=2.5,
                     memory_mb=4096)
    root = ET.fromstring(domain_xml(spec, node="n1", pci_bus_ids=["00000000:28:00.0", "00000000:48:00.0"],
                                    kernel="/k", initrd="/i", console_log="/tmp/c.log"))
    assert root.get("type") == "kvm" and root.findtext("name") == "gpuportal-j1-2"
    assert root.findtext("vcpu") == "3" and root.find("memory").text == str(4096 + 96)
    # 2.5 CPUs of host time for the whole domain, on 3 vCPUs.
    assert (root.findtext("cputune/global_period"), root.findtext("cputune/global_quota")) == ("100000", "250000")
    hostdevs = root.findall("devices/hostdev")
    assert [h.find("source/address").get("bus") for h in hostdevs] == ["0x28", "0x48"]
    assert all(h.get("managed") == "yes" and h.find("driver").get("name") == "vfio" for h in hostdevs)
    assert root.find("devices/interface") is None  # no network device at all
    assert root.find("memoryBacking/locked") is not None and root.find("features/acpi") is not None
    md = root.find(f"metadata/{{{METADATA_NS}}}job")
    assert (md.get("job"), md.get("attempt"), md.get("node"), md.get("gpus")) == ("j1", "2", "n1", "1,3")


@pytest.fixture
def kvm(tmp_path):
    try:
        import libvirt  # noqa: F401
    except ImportError:
        pytest.fail("libvirt-python is not installed; .ci/kvm.sh installs it (libvirt-dev + pip)", pytrace=False)
    from agents.sandbox.kvm_driver import KvmDriver

    d = KvmDriver(node="n1", uri="test:///default", domain_type="test", state_dir=str(tmp_path),
                  pci_bus_ids={0: "00000000:18:00.0", 1: "00000000:28:00.0"})
    yield d
    d.conn.close()


def test_lifecycle_on_the_libvirt_test_driver(kvm, tmp_path):
    spec = make_spec(job_id="vm1", gpu_indexes=[1], gpu_uuids=["GPU-b"])
    h = kvm.launch(spec)
    assert kvm.poll(h) == (RUNNING, None)
    xml = kvm.conn.lookupByName(h.ref).XMLDesc()
    assert "0x28" in xml and "vfio" in xml  # libvirt kept the hostdev it parsed
    ((job, attempt, h2),) = kvm.list_own()
    assert (job, attempt, h2.gpu_indexes, h2.time_limit_s) == ("vm1", 1, [1], 60)
    assert abs(h2.started_at - h.started_at) < 0.01
    with pytest.raises(SandboxError, match="already exists"):
        kvm.launch(spec)
    # The console as the guest writes it: kernel noise around the job's output, between the markers.
    console = kvm.state_dir / f"{h.ref}.log"
    console.write_bytes(b"[ 0.1] booting\nGPUPORTAL-JOB-START\nout\nparti")
    assert kvm.read_logs(h, 0) == b"out\n"  # running: only complete lines
    console.write_bytes(b"[ 0.1] booting\nGPUPORTAL-JOB-START\nout\npartial\nGPUPORTAL-JOB-EXIT rc=0\n"
                        b"[ 2.0] reboot: Power down\n")
    kvm.stop(h, grace_s=0.2)
    # The console's marker delimits the output only: the code comes from the second serial port.
    assert kvm.poll(h) == (EXITED, None) and kvm.read_logs(h, 4) == b"partial\n"
    (kvm.state_dir / f"{h.ref}.exit").write_bytes(b"GPUPORTAL-JOB-EXIT rc=3 oom_kill=0\n")
    assert kvm.poll(h) == (EXITED, 3)
    (kvm.state_dir / f"{h.ref}.exit").write_bytes(b"GPUPORTAL-JOB-EXIT rc=137 oom_kill=1\n")
    assert kvm.poll(h) == (OOM, 137)
    kvm.remove(h)
    assert kvm.list_own() == []


def test_an_attempt_whose_vm_ended_while_the_agent_was_down_is_adopted_with_its_exit_code(kvm, tmp_path):
    """list_own sees live VMs only through libvirt; an ended one leaves its record, console and exit
    files, from which a restarted agent reports the real code once (then remove clears them). No exit
    record: the code is unknown, never 0. A record whose VM never started is not adopted and goes."""
    from agents.sandbox.kvm_driver import KvmDriver

    def restarted():
        return KvmDriver(node="n1", uri="test:///default", domain_type="test", state_dir=str(tmp_path))

    handles = {j: kvm.launch(make_spec(job_id=j, gpu_indexes=[0], gpu_uuids=["GPU-a"])) for j in ("ok", "bad", "lost")}
    for j, h in handles.items():
        (kvm.state_dir / f"{h.ref}.log").write_bytes(b"GPUPORTAL-JOB-START\nout\nGPUPORTAL-JOB-EXIT rc=0\n")
        kvm.conn.lookupByName(h.ref).destroy()  # the VM powers off while no agent runs
    (kvm.state_dir / f"{handles['ok'].ref}.exit").write_bytes(b"GPUPORTAL-JOB-EXIT rc=0 oom_kill=0\n")
    (kvm.state_dir / f"{handles['bad'].ref}.exit").write_bytes(b"GPUPORTAL-JOB-EXIT rc=3 oom_kill=0\n")
    never = kvm.launch(make_spec(job_id="never"))
    kvm.conn.lookupByName(never.ref).destroy()  # a launch that died before its VM started: no console
    d = restarted()
    assert not (d.state_dir / f"{never.ref}.json").exists()
    found = {job: h for job, _, h in d.list_own()}
    assert sorted(found) == ["bad", "lost", "ok"]
    assert found["ok"].gpu_indexes == [0] and abs(found["ok"].started_at - handles["ok"].started_at) < 0.01
    assert d.poll(found["ok"]) == (EXITED, 0) and d.read_logs(found["ok"], 0) == b"out\n"
    assert d.poll(found["bad"]) == (EXITED, 3)
    assert d.poll(found["lost"]) == (EXITED, None)
    for h in found.values():
        d.remove(h)
    assert d.list_own() == [] and restarted().list_own() == [] and list(d.state_dir.iterdir()) == []
    d.conn.close()

def test_two_agents_on_one_libvirtd_run_the_same_attempt_and_adopt_only_their_own(kvm, tmp_path):
    """A second agent (another node, or another installation with the same node name) sharing libvirtd:
    the same job attempt starts on each, and each finds only its own VMs after a restart."""
    from agents.sandbox.kvm_driver import KvmDriver

    others = [KvmDriver(node=node, uri="test:///default", domain_type="test", state_dir=str(tmp_path / node),
                        installation=inst) for node, inst in (("n2", ""), ("n1", "staging"))]
    spec = make_spec(job_id="shared-1")
    handles = [d.launch(spec) for d in (kvm, *others)]
    assert len({h.ref for h in handles}) == 3 and all("n1" in h.ref or "n2" in h.ref for h in handles)
    for d, h in zip((kvm, *others), handles):
        assert [found.ref for _, _, found in d.list_own()] == [h.ref]
    for d, h in zip((kvm, *others), handles):
        d.remove(h)
        assert d.list_own() == []
    for d in others:
        d.conn.close()


def test_gpu_without_a_known_pci_address_is_refused(kvm):
    with pytest.raises(SandboxError, match="no PCI address"):
        kvm.launch(make_spec(gpu_indexes=[5], gpu_uuids=["GPU-x"]))


# -- the job's image as cpio ----------------------------------------------------

def read_cpio(data: bytes) -> dict[str, dict]:
    """A newc archive's entries by name, as the kernel's unpacker reads them."""
    out, pos = {}, 0
    while True:
        assert data[pos:pos + 6] == b"070701"
        f = [int(data[pos + 6 + 8 * i:pos + 14 + 8 * i], 16) for i in range(13)]
        name = data[pos + 110:pos + 110 + f[11] - 1].decode()
        pos = (pos + 110 + f[11] + 3) & ~3
        body, pos = data[pos:pos + f[6]], (pos + f[6] + 3) & ~3
        if name == "TRAILER!!!":
            return out
        out[name] = dict(ino=f[0], mode=f[1], uid=f[2], gid=f[3], nlink=f[4], mtime=f[5], data=body)


def tar_of(*entries) -> io.BytesIO:
    """A tar as `docker export` streams it: (name, type, data or link target, TarInfo fields)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, payload, *fields in entries:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mtime = kind, 1700000000
            for k, v in (fields[0] if fields else {}).items():
                setattr(ti, k, v)
            if kind == tarfile.REGTYPE:
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            else:
                ti.linkname = payload or ""
                tf.addfile(ti)
    buf.seek(0)
    return buf


def test_an_image_tar_becomes_cpio_under_image():
    out = io.BytesIO()
    n = image_cpio(tar_of(
        ("./", tarfile.DIRTYPE, None),
        ("etc/", tarfile.DIRTYPE, None, {"mode": 0o755}),
        ("etc/marker", tarfile.REGTYPE, b"hi\n", {"mode": 0o640, "gid": 42}),
        ("work/notes", tarfile.REGTYPE, b"", {"uid": 65534}),  # its directory comes only implied
        ("bin/sh", tarfile.SYMTYPE, "/bin/busybox"),
        ("etc/marker.bak", tarfile.LNKTYPE, "etc/marker"),
        ("dev/null", tarfile.CHRTYPE, None, {"devmajor": 1, "devminor": 3}),
        ("run/fifo", tarfile.FIFOTYPE, None),
    ), out)
    e = read_cpio(out.getvalue())
    assert set(e) == {"image", "image/etc", "image/etc/marker", "image/work", "image/work/notes", "image/bin",
                      "image/bin/sh", "image/etc/marker.bak"}
    assert n == {"files": 2, "bytes": 3, "links": 1, "skipped": 2}  # the device and the fifo
    m = e["image/etc/marker"]
    assert (m["data"], m["mode"], m["gid"], m["mtime"]) == (b"hi\n", stat.S_IFREG | 0o640, 42, 1700000000)
    assert e["image/work/notes"]["uid"] == 65534
    assert e["image/bin/sh"]["mode"] == stat.S_IFLNK | 0o777 and e["image/bin/sh"]["data"] == b"/bin/busybox"
    # A hard link: the target's inode, both with nlink 2, the data once.
    link = e["image/etc/marker.bak"]
    assert (link["ino"], link["nlink"], m["nlink"], link["data"]) == (m["ino"], 2, 2, b"")


def test_image_paths_that_could_leave_image_are_skipped():
    out = io.BytesIO()
    n = image_cpio(tar_of(
        ("/abs", tarfile.REGTYPE, b"x"),
        ("../escape", tarfile.REGTYPE, b"x"),
        ("a/../../b", tarfile.DIRTYPE, None),
        ("evil", tarfile.SYMTYPE, "/"),
        ("evil/init", tarfile.REGTYPE, b"pwned"),  # the unpacker would write /init through the symlink
        ("evil", tarfile.CHRTYPE, None),  # skipped, so the symlink stays
        ("evil/init", tarfile.REGTYPE, b"pwned"),
        ("evil/sub/", tarfile.DIRTYPE, None),
        ("x.bak", tarfile.LNKTYPE, "../etc/passwd"),
        ("evil", tarfile.DIRTYPE, None),  # a directory replaces the symlink: now paths under it are safe
        ("evil/ok", tarfile.REGTYPE, b"fine"),
    ), out)
    e = read_cpio(out.getvalue())
    assert set(e) == {"image", "image/evil", "image/evil/ok"} and n["skipped"] == 8
    assert stat.S_ISDIR(e["image/evil"]["mode"])


def test_header_fields_never_overflow_and_shift_the_archive():
    """A far-future mtime (PAX tars carry any) would widen its header field; the unpacker would then read
    file data as headers, i.e. entries of the image's choosing anywhere in the guest. It is clamped."""
    out = io.BytesIO()
    smuggled = b"070701" + b"0" * 104 + b"init\0"  # what a shifted reader could take for a header
    image_cpio(tar_of(("future", tarfile.REGTYPE, smuggled, {"mtime": 2 ** 33}),
                      ("after", tarfile.REGTYPE, b"ok")), out)
    e = read_cpio(out.getvalue())
    assert set(e) == {"image", "image/future", "image/after"}
    assert e["image/future"]["mtime"] == 0xFFFFFFFF and e["image/after"]["data"] == b"ok"
    with pytest.raises(ImageError, match="uid 4294967296 does not fit"):
        image_cpio(tar_of(("big", tarfile.REGTYPE, b"", {"uid": 2 ** 32})), io.BytesIO())


def test_an_image_over_the_limit_is_refused_while_converting():
    with pytest.raises(ImageError, match="add up to more than"):
        image_cpio(tar_of(("a", tarfile.REGTYPE, b"x" * 600), ("b", tarfile.REGTYPE, b"x" * 600)),
                   io.BytesIO(), max_bytes=1000)


# -- image errors the job's owner reads ------------------------------------------

@pytest.fixture
def qemu_driver(tmp_path):
    """A driver that would boot (domain type qemu) but stops at the image, before libvirt's test driver."""
    from agents.sandbox.kvm_driver import KvmDriver

    for f in ("vmlinux", "initramfs.cpio.gz"):
        (tmp_path / f).write_bytes(b"")
    (tmp_path / "manifest.json").write_text(json.dumps({
        "build_version": BUILD_VERSION, "kernel": str(tmp_path / "vmlinux"),
        "initrd": str(tmp_path / "initramfs.cpio.gz")}))

    def make(**kw):
        return KvmDriver(node="n1", uri="test:///default", domain_type="qemu", image_dir=str(tmp_path),
                         state_dir=str(tmp_path), **kw)
    return make


def test_an_image_over_the_nodes_limit_is_refused(qemu_driver, docker_client):
    d = qemu_driver(max_image_mb=1)
    with pytest.raises(SandboxError, match=r"image 'gpuportal/busybox:latest' is 2 MiB, over the kvm sandbox's "
                                           r"limit of 1 MiB on node n1 \(a VM holds its image in memory\)"):
        d.launch(make_spec())
    assert d.list_own() == [] and not d.image_cache.exists()


def test_a_dead_docker_engine_is_named_as_the_image_source(qemu_driver, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    with pytest.raises(SandboxError, match="the kvm sandbox reads job images from node n1's Docker engine, "
                                           "which is not answering"):
        qemu_driver().launch(make_spec())


def test_a_guest_image_of_an_older_build_is_refused(qemu_driver, tmp_path):
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps(dict(m, build_version=BUILD_VERSION - 1)))
    with pytest.raises(SandboxError, match=f"is of build {BUILD_VERSION - 1}, this agent needs build "
                                           f"{BUILD_VERSION}; build it with"):
        qemu_driver().launch(make_spec())


@pytest.mark.parametrize("raw", ["lots", "0", "-5"])
def test_a_bad_image_size_limit_is_named(tmp_path, monkeypatch, raw):
    from agents.sandbox import SandboxError
    from agents.sandbox.kvm_driver import KvmDriver

    monkeypatch.setenv("GPUPORTAL_KVM_MAX_IMAGE_MB", raw)
    with pytest.raises(SandboxError, match="GPUPORTAL_KVM_MAX_IMAGE_MB: expected a positive number"):
        KvmDriver(node="n1", uri="test:///default", domain_type="test", state_dir=str(tmp_path))
    monkeypatch.setenv("GPUPORTAL_KVM_MAX_IMAGE_MB", "64")
    assert KvmDriver(node="n1", uri="test:///default", domain_type="test", state_dir=str(tmp_path)).max_image_mb == 64


def test_the_image_cache_drops_gone_images_stale_leftovers_and_the_least_recently_used(
        qemu_driver, docker_client, tmp_path):
    import os
    import time

    d = qemu_driver(image_cache_mb=1)
    d.image_cache.mkdir(parents=True)
    present = docker_client.images.get("gpuportal/busybox:latest").id.split(":")[-1]
    kept, old = d.image_cache / f"{present}.cpio.gz", d.image_cache / f"{'0' * 64}.cpio.gz"
    kept.write_bytes(b"x" * 1000)
    old.write_bytes(b"x")  # an image the engine no longer has
    stale, fresh = d.image_cache / ".abc.cpio.gz.tmp1", d.image_cache / ".abc.cpio.gz.tmp2"
    stale.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    leftover = docker_client.containers.create("gpuportal/busybox:latest", command=["true"],
                                               labels={"gpuportal.kvm_export": "n1"})
    gone = d.prune_image_cache()
    assert sorted(gone) == sorted([f"container {leftover.short_id}", old.name, stale.name])
    assert kept.exists() and fresh.exists()
    # Over the cache's size (1 MiB) the least recently used goes, never the one just built.
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("etc/lru-test")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"1"))
    docker_client.api.import_image_from_data(buf.getvalue(), repository="gpuportal/lru-test", tag="1")
    second = docker_client.images.get("gpuportal/lru-test:1")
    try:
        other = d.image_cache / f"{second.id.split(':')[-1]}.cpio.gz"
        for p, age in ((kept, 100), (other, 50)):
            p.write_bytes(b"x" * (600 << 10))
            os.utime(p, (time.time() - age, time.time() - age))
        assert d.prune_image_cache() == [kept.name]  # 1.2 MiB: the older use goes
        kept.write_bytes(b"x" * (600 << 10))
        assert d.prune_image_cache(keep=kept) == [other.name]  # just built: stays though newer
    finally:
        docker_client.images.remove(second.id, force=True)


# -- egress policy ----------------------------------------------------------------

def test_the_egress_chain_blocks_the_node_and_private_ranges_and_opens_what_the_operator_allows():
    import ipaddress

    from agents.sandbox.egress import Firewall, parse_allow

    fw = Firewall(chain="GPUPORTAL-KVM-1", hooks=[], allow=parse_allow("10.1.2.0/24, 2001:db8:1::5"),
                  resolvers=[ipaddress.ip_address("10.255.255.53")])
    v4 = [" ".join(r) for r in fw.rules(4)]
    # First what is allowed, then the node's own addresses, then the ranges; the rest (public) passes.
    assert v4[:4] == ["-d 10.1.2.0/24 -j RETURN", "-p udp -d 10.255.255.53 --dport 53 -j RETURN",
                      "-p tcp -d 10.255.255.53 --dport 53 -j RETURN", "-m addrtype --dst-type LOCAL -j REJECT"]
    for cidr in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
                 "100.64.0.0/10"):
        assert f"-d {cidr} -j REJECT" in v4
    v6 = [" ".join(r) for r in fw.rules(6)]
    assert v6[0] == "-d 2001:db8:1::5/128 -j RETURN"
    assert {"-d ::1/128 -j REJECT", "-d fc00::/7 -j REJECT", "-d fe80::/10 -j REJECT"} <= set(v6)


def test_a_bad_egress_allow_entry_is_named(tmp_path):
    from agents.sandbox.kvm_driver import KvmDriver

    with pytest.raises(SandboxError, match=r"--egress-allow: 'no such host\.invalid' is neither a CIDR nor"):
        KvmDriver(node="n1", uri="test:///default", domain_type="test", state_dir=str(tmp_path),
                  egress_allow="10.0.0.0/8,no such host.invalid")


# -- the driver's state folder ------------------------------------------------------

def test_the_state_folder_is_made_private(tmp_path):
    import os

    from agents.sandbox.kvm_domain import private_dir

    d = private_dir(tmp_path / "agent" / "kvm-n1")
    st = os.lstat(d)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o711)
    assert private_dir(d) == d  # found again as it was left


@pytest.mark.parametrize("plant", ["symlink", "world-readable", "foreign", "open-parent"])
def test_a_state_folder_someone_else_could_touch_is_refused(tmp_path, plant):
    """A local user who makes the folder first (or a link to somewhere else) must not get the jobs'
    initrds, with their secret environment, nor make root write through a link."""
    import os

    from agents.sandbox.kvm_domain import private_dir

    agent = tmp_path / "agent"
    agent.mkdir()
    target = agent / "kvm-n1"
    if plant == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "elsewhere")
    elif plant == "world-readable":
        target.mkdir()
        target.chmod(0o755)
    elif plant == "foreign":
        target.mkdir(mode=0o711)
        os.chown(target, 12345, 12345)
    else:
        agent.chmod(0o777)  # anyone could rename ours away and put theirs in its place
    with pytest.raises(SandboxError, match="refusing state folder"):
        private_dir(target)


def test_a_link_planted_at_a_launch_file_is_replaced_not_followed(qemu_driver, docker_client, tmp_path):
    victim = tmp_path / "root-only"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    d = qemu_driver()
    spec = make_spec()
    for suffix in (".initrd", ".kernel"):
        (d.state_dir / f"{d.vm_name(spec)}{suffix}").symlink_to(victim)
    h = d.launch(spec)  # libvirt's test driver "runs" it: the kernel and initrd were written and used
    d.remove(h)
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in d.state_dir.iterdir()) == []  # the launch's files are gone again


def test_converting_an_image_with_volumes_leaves_no_volume_behind(qemu_driver, docker_client):
    """`docker create` makes an anonymous volume for each VOLUME of the image; the export container must
    take them along when it goes."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("etc/volume-test")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"1"))
    docker_client.api.import_image_from_data(buf.getvalue(), repository="gpuportal/volume-test", tag="1",
                                             changes=["VOLUME /data", "VOLUME /cache"])
    image = docker_client.images.get("gpuportal/volume-test:1")
    before = {v.id for v in docker_client.volumes.list()}
    d = qemu_driver()
    try:
        h = d.launch(make_spec(image="gpuportal/volume-test:1", command=["true"]))
        d.remove(h)
        assert (d.image_cache / f"{image.id.split(':')[-1]}.cpio.gz").is_file()
        assert {v.id for v in docker_client.volumes.list()} - before == set()
    finally:
        docker_client.images.remove(image.id, force=True)


# -- bounded conversion ---------------------------------------------------------------

def deep_tar(depth: int, files: int) -> io.BytesIO:
    """``depth`` nested folders with ``files`` files at the bottom (the slow image of the issue)."""
    path, entries = "", []
    for _ in range(depth):
        path += "d/"
        entries.append((path, tarfile.DIRTYPE, None))
    entries += [(f"{path}f{i}", tarfile.REGTYPE, b"x") for i in range(files)]
    return tar_of(*entries)


def test_a_deep_image_converts_in_linear_time_and_completely():
    """1,900 nested folders and 2,000 files: this took about 50 s of CPU before (a quadratic path check);
    the figure is in the report, not asserted."""
    out = io.BytesIO()
    n = image_cpio(deep_tar(1900, 2000), out)
    assert n == {"files": 2000, "bytes": 2000, "links": 0, "skipped": 0}
    e = read_cpio(out.getvalue())
    assert len(e) == 1 + 1900 + 2000 and "image/" + "d/" * 1900 + "f1999" in e


def test_an_image_over_the_entry_limit_or_the_time_limit_or_cancelled_is_refused():
    import threading

    with pytest.raises(ImageError, match="it holds more than 1000 files and folders, the limit of this node"):
        image_cpio(deep_tar(10, 2000), io.BytesIO(), max_entries=1000)
    with pytest.raises(ImageError, match="its conversion took longer than 0 s"):
        image_cpio(deep_tar(10, 2000), io.BytesIO(), time_limit_s=0)
    stopped = threading.Event()
    stopped.set()
    with pytest.raises(ImageError, match="its conversion was cancelled: the job was stopped"):
        image_cpio(deep_tar(10, 10), io.BytesIO(), cancel=stopped)


def test_a_stop_during_an_image_conversion_ends_it(qemu_driver, docker_client):
    """The agent passes a stop that overtakes a launch on to the driver: the conversion ends at once,
    no VM starts (the job's time limit has not even begun)."""
    import threading
    import time

    buf = deep_tar(5, 8000)
    docker_client.api.import_image_from_data(buf.getvalue(), repository="gpuportal/many-files", tag="1")
    image = docker_client.images.get("gpuportal/many-files:1")
    d = qemu_driver()
    spec = make_spec(image="gpuportal/many-files:1")
    result = {}

    def launch():
        t0 = time.monotonic()
        try:
            d.launch(spec)
        except SandboxError as exc:
            result["error"] = str(exc)
        result["s"] = time.monotonic() - t0

    t = threading.Thread(target=launch)
    try:
        t.start()
        deadline = time.monotonic() + 30
        while (spec.job_id, 1) not in d._cancels and time.monotonic() < deadline:
            time.sleep(0.01)
        d.cancel_launch(spec.job_id, 1)
        t.join(timeout=60)
        assert "its conversion was cancelled: the job was stopped" in result["error"], result
        assert d.list_own() == [] and not (d.image_cache / f"{image.id.split(':')[-1]}.cpio.gz").exists()
    finally:
        t.join(timeout=60)
        docker_client.images.remove(image.id, force=True)


def test_a_launch_stopped_during_its_image_conversion_is_reported_cancelled(qemu_driver, docker_client):
    """Through the agent: the portal's stop ends the conversion, and the job ends `cancelled` with the
    stop's reason (it was reported `failed`, "conversion was cancelled")."""
    import threading
    import time

    from agents.probe.sim import SimProbe
    from agents.worker import Agent
    from tests.agents.fakes import Clock, FakePortal

    buf = deep_tar(5, 8000)
    docker_client.api.import_image_from_data(buf.getvalue(), repository="gpuportal/many-files", tag="2")
    image = docker_client.images.get("gpuportal/many-files:2")
    d = qemu_driver()
    clock = Clock()
    portal = FakePortal(clock)
    agent = Agent(name="n1", client=portal, driver=d, probe=SimProbe("1xH100-80GB", node_name="n1"),
                  stop_grace_s=0.0, background=False, clock=clock)
    agent.register()
    spec = {"image": "gpuportal/many-files:2", "command": ["true"], "cpus": 1, "memory_mb": 64,
            "time_limit_s": 60, "sandbox": "kvm"}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", agent.launch("j-conv", 1, spec)))
    try:
        t.start()
        deadline = time.monotonic() + 30
        while ("j-conv", 1) not in d._cancels and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent.stop("j-conv", 1, "cancelled by its owner") is True
        t.join(timeout=60)
        assert portal.states("j-conv") == ["starting", "cancelled"], portal.events
        assert portal.events[-1][2:] == ("cancelled", None, "cancelled by its owner")
        assert result["r"] == "stale" and agent.jobs() == {} and d.list_own() == []
    finally:
        t.join(timeout=60)
        docker_client.images.remove(image.id, force=True)

# -- the console across virtlogd's rotation --------------------------------------------

def test_the_console_reads_whole_across_rotations_and_offsets_never_move(tmp_path):
    """virtlogd's scheme: the live file moves to .0, older ones shift up, the oldest beyond its backups
    is deleted. Read between rotations (the agent reads every second), nothing is lost."""
    import os

    from agents.sandbox.kvm_console import console_files, read_console

    live, written, reads = tmp_path / "vm.log", b"", []

    def write(data):
        nonlocal written
        with open(live, "ab") as f:
            f.write(data)
        written += data

    def rotate(backups=3):
        gone = live.with_name(f"vm.log.{backups - 1}")
        if gone.exists():
            gone.unlink()
        for i in range(backups - 2, -1, -1):
            if live.with_name(f"vm.log.{i}").exists():
                os.rename(live.with_name(f"vm.log.{i}"), live.with_name(f"vm.log.{i + 1}"))
        os.rename(live, live.with_name("vm.log.0"))

    for i in range(7):  # more rotations than backups: the first files are deleted along the way
        write(f"chunk {i}: ".encode() + b"x" * 1000 + b"\n")
        reads.append(read_console(live))
        rotate()
        reads.append(read_console(live))
    write(b"tail\n")
    assert read_console(live) == written
    assert all(written.startswith(r) for r in reads)  # every earlier read is a prefix: offsets hold
    assert not live.with_name("vm.log.3").exists() and live.with_name("vm.log.2").exists()
    for f in console_files(live):
        f.unlink(missing_ok=True)
    assert list(tmp_path.iterdir()) == []


def test_a_restarted_agent_serves_a_live_vms_terminal_session_again(kvm, tmp_path):
    """The launch's record keeps the VM's terminal session (0600, in the agent's folder): a restarted
    agent's gateway publishes it for the live VM, on the VM's serial socket; an ended VM's is not."""
    from agents.sandbox.kvm_driver import KvmDriver
    from agents.sessions import Gateway, SessionDriver

    sh = {"name": "sh", "kind": "terminal", "port": None, "secret": "k" * 32, "base_url": "/sessions/t1/sh/"}
    live = kvm.launch(make_spec(job_id="t1", sessions=[sh]))
    assert "type='unix'" in kvm.conn.lookupByName(live.ref).XMLDesc()
    gone = kvm.launch(make_spec(job_id="t2", sessions=[{**sh, "base_url": "/sessions/t2/sh/"}]))
    (kvm.state_dir / f"{gone.ref}.log").write_bytes(b"GPUPORTAL-JOB-START\n")
    kvm.conn.lookupByName(gone.ref).destroy()
    assert (kvm._record_path(live.ref).stat().st_mode & 0o777) == 0o600
    gateway = Gateway(listen="127.0.0.1:0").start()
    try:
        driver = SessionDriver(KvmDriver(node="n1", uri="test:///default", domain_type="test",
                                         state_dir=str(tmp_path)), gateway)
        assert sorted(job for job, _, _ in driver.list_own()) == ["t1", "t2"]
        assert sorted(gateway._published) == ["t1"]
        pub = gateway._published["t1"]
        assert pub.sessions == {"sh": sh} and pub.shell.path == str(kvm._terminal_path(live.ref))
    finally:
        gateway.stop()
        for h in (live, gone):
            kvm.remove(h)
    assert not kvm._terminal_path(live.ref).parent.exists()
