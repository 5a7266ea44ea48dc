"""KVM sandbox: domain XML always; lifecycle against libvirt's test driver
(test:///default, no daemon) when libvirt-python is installed."""

import xml.etree.ElementTree as ET

import pytest

from agents.sandbox import EXITED, RUNNING, SandboxError
from agents.sandbox.kvm_driver import METADATA_NS, domain_xml, pci_address
from tests.agents.conftest import make_spec


def test_pci_address_from_nvml_bus_id():
    assert pci_address("00000000:3B:00.0") == {"domain": "0x0000", "bus": "0x3b", "slot": "0x00", "function": "0x0"}
    assert pci_address("0001:af:1f.7") == {"domain": "0x0001", "bus": "0xaf", "slot": "0x1f", "function": "0x7"}
    with pytest.raises(SandboxError):
        pci_address("GPU-abc")


def test_domain_xml_passes_only_the_allocated_gpus_and_no_nic():
    spec = make_spec(job_id="j1", attempt=2, gpu_indexes=[1, 3], gpu_uuids=["GPU-a", "GPU-b"], cpus=2.5,
                     memory_mb=4096)
    root = ET.fromstring(domain_xml(spec, node="n1", pci_bus_ids=["00000000:28:00.0", "00000000:48:00.0"],
                                    kernel="/k", initrd="/i", console_log="/tmp/c.log"))
    assert root.get("type") == "kvm" and root.findtext("name") == "gpuportal-j1-2"
    assert root.findtext("vcpu") == "3" and root.find("memory").text == "4096"
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

    d = KvmDriver(node="n1", uri="test:///default", domain_type="test", log_dir=str(tmp_path),
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
    console = tmp_path / f"{h.ref}.log"
    console.write_bytes(b"[ 0.1] booting\nGPUPORTAL-JOB-START\nout\nparti")
    assert kvm.read_logs(h, 0) == b"out\n"  # running: only complete lines
    console.write_bytes(b"[ 0.1] booting\nGPUPORTAL-JOB-START\nout\npartial\nGPUPORTAL-JOB-EXIT rc=3\n"
                        b"[ 2.0] reboot: Power down\n")
    kvm.stop(h, grace_s=0.2)
    assert kvm.poll(h) == (EXITED, 3) and kvm.read_logs(h, 4) == b"partial\n"
    kvm.remove(h)
    assert kvm.list_own() == []


def test_gpu_without_a_known_pci_address_is_refused(kvm):
    with pytest.raises(SandboxError, match="no PCI address"):
        kvm.launch(make_spec(gpu_indexes=[5], gpu_uuids=["GPU-x"]))
