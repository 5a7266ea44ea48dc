"""KVM sandbox through libvirt: one transient VM per job attempt, its GPUs
passed through whole by PCI address (VFIO).

What is here: the domain XML (``domain_xml``, pure, tested without libvirt)
and the lifecycle over a libvirt connection, tested against libvirt's test
driver (``test:///default``). What is not: a guest image and the in-guest
runner that would read the job's command from the domain metadata, run it and
print ``GPUPORTAL-JOB-EXIT rc=N`` on the serial console (the exit-code protocol
``poll`` reads). Booting is also untested here: the development machines have
no VFIO and a PVM-only /dev/kvm (shared/notes/sandboxes.md section 2).

Needs ``libvirt-python`` (and libvirt on the host); imported lazily so the rest
of the agent runs without it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from agents.sandbox import EXITED, RUNNING, LaunchSpec, SandboxError, SandboxHandle, sandbox_name

log = logging.getLogger(__name__)

METADATA_NS = "https://gpuportal.dev/xmlns/agent/1"
EXIT_RE = re.compile(rb"GPUPORTAL-JOB-EXIT rc=(\d+)")
ET.register_namespace("gpuportal", METADATA_NS)
_PCI_RE = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def pci_address(bus_id: str) -> dict[str, str]:
    """NVML's "00000000:3B:00.0" -> libvirt's domain/bus/slot/function attributes."""
    m = _PCI_RE.match(bus_id.strip())
    if not m:
        raise SandboxError(f"not a PCI bus id: {bus_id!r}")
    dom, bus, slot, fn = m.groups()
    return {"domain": f"0x{int(dom or '0', 16) & 0xFFFF:04x}", "bus": f"0x{int(bus, 16):02x}",
            "slot": f"0x{int(slot, 16):02x}", "function": f"0x{int(fn, 16):x}"}


def domain_xml(spec: LaunchSpec, *, node: str, pci_bus_ids: list[str], kernel: str, initrd: str,
               console_log: str, domain_type: str = "kvm", started_at: float | None = None) -> str:
    """The libvirt domain for one job attempt.

    No NIC unless the job may use the network (then still none here: a per-job
    network with egress policy is the portal's to define). Memory is locked
    when GPUs are passed through, because VFIO DMA needs pinned guest memory.
    """
    d = ET.Element("domain", type=domain_type)
    ET.SubElement(d, "name").text = sandbox_name(spec.job_id, spec.attempt)
    md = ET.SubElement(ET.SubElement(d, "metadata"), f"{{{METADATA_NS}}}job", {
        "job": spec.job_id, "attempt": str(spec.attempt), "node": node,
        "time_limit_s": str(spec.time_limit_s), "gpus": ",".join(map(str, spec.gpu_indexes)),
        "started_at": f"{time.time() if started_at is None else started_at:.3f}"})
    # The in-guest runner reads its command and environment from here.
    md.text = json.dumps({"command": spec.command, "env": spec.env, "image": spec.image})
    ET.SubElement(d, "memory", unit="MiB").text = str(spec.memory_mb)
    ET.SubElement(d, "vcpu").text = str(max(1, math.ceil(spec.cpus)))
    os_ = ET.SubElement(d, "os")
    ET.SubElement(os_, "type", arch="x86_64", machine="q35").text = "hvm"
    ET.SubElement(os_, "kernel").text = kernel
    ET.SubElement(os_, "initrd").text = initrd
    ET.SubElement(os_, "cmdline").text = f"console=ttyS0 panic=-1 gpuportal.job={spec.job_id}"
    feats = ET.SubElement(d, "features")
    ET.SubElement(feats, "acpi")  # without it poweroff never ends the domain (sandboxes.md)
    if spec.gpu_uuids:
        # Older NVIDIA drivers refuse to start when they see a hypervisor.
        ET.SubElement(ET.SubElement(feats, "kvm"), "hidden", state="on")
        ET.SubElement(ET.SubElement(d, "memoryBacking"), "locked")
    if domain_type == "kvm":
        ET.SubElement(d, "cpu", mode="host-passthrough")
    for ev in ("on_poweroff", "on_reboot", "on_crash"):
        ET.SubElement(d, ev).text = "destroy"
    dev = ET.SubElement(d, "devices")
    serial = ET.SubElement(dev, "serial", type="pty")
    ET.SubElement(serial, "log", file=console_log, append="off")
    ET.SubElement(serial, "target", port="0")
    ET.SubElement(ET.SubElement(dev, "console", type="pty"), "target", type="serial", port="0")
    for bus_id in pci_bus_ids:
        hd = ET.SubElement(dev, "hostdev", mode="subsystem", type="pci", managed="yes")
        ET.SubElement(hd, "driver", name="vfio")
        ET.SubElement(ET.SubElement(hd, "source"), "address", pci_address(bus_id))
        ET.SubElement(hd, "rom", bar="off")
    ET.SubElement(dev, "memballoon", model="none")
    return ET.tostring(d, encoding="unicode")


class KvmDriver:
    name = "kvm"

    def __init__(self, *, node: str, uri: str = "qemu:///system", domain_type: str = "kvm",
                 kernel: str = "/var/lib/gpuportal/vm/vmlinux", initrd: str = "/var/lib/gpuportal/vm/initrd.img",
                 log_dir: str | None = None, pci_bus_ids: dict[int, str] | None = None):
        try:
            import libvirt
        except ImportError as exc:
            raise SandboxError("the kvm sandbox needs libvirt-python (pip install libvirt-python)") from exc
        self._libvirt = libvirt
        self.node = node
        self.domain_type = domain_type
        self.kernel, self.initrd = kernel, initrd
        self.log_dir = Path(log_dir or Path(tempfile.gettempdir()) / f"gpuportal-kvm-{node}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # GPU index -> PCI bus id, from the probe's inventory (set by the caller).
        self.pci_bus_ids = dict(pci_bus_ids or {})
        try:
            self.conn = libvirt.open(uri)
        except libvirt.libvirtError as exc:
            raise SandboxError(f"libvirt at {uri} is not answering: {exc}") from exc

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        try:
            buses = [self.pci_bus_ids[i] for i in spec.gpu_indexes]
        except KeyError as exc:
            raise SandboxError(f"no PCI address known for GPU {exc.args[0]}") from None
        name = sandbox_name(spec.job_id, spec.attempt)
        started = time.time()
        xml = domain_xml(spec, node=self.node, pci_bus_ids=buses, kernel=self.kernel, initrd=self.initrd,
                         console_log=str(self.log_dir / f"{name}.log"), domain_type=self.domain_type,
                         started_at=started)
        try:
            self.conn.createXML(xml, 0)
        except self._libvirt.libvirtError as exc:
            raise SandboxError(f"could not start the VM: {exc.get_error_message()}") from None
        return SandboxHandle(driver=self.name, ref=name, job_id=spec.job_id, attempt=spec.attempt,
                             started_at=started, time_limit_s=spec.time_limit_s,
                             gpu_indexes=list(spec.gpu_indexes))

    def _dom(self, ref: str):
        try:
            return self.conn.lookupByName(ref)
        except self._libvirt.libvirtError:
            return None  # transient domains vanish once stopped

    def poll(self, handle: SandboxHandle) -> tuple[str, int | None]:
        dom = self._dom(handle.ref)
        if dom is not None and dom.isActive():
            return RUNNING, None
        m = EXIT_RE.search(self.read_logs(handle, 0))
        return EXITED, (int(m.group(1)) if m else None)

    def read_logs(self, handle: SandboxHandle, offset: int) -> bytes:
        try:
            with open(self.log_dir / f"{handle.ref}.log", "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    def stop(self, handle: SandboxHandle, grace_s: float) -> None:
        """ACPI power button (the guest's init sends SIGTERM to the job), then destroy."""
        dom = self._dom(handle.ref)
        if dom is None or not dom.isActive():
            return
        try:
            dom.shutdown()
        except self._libvirt.libvirtError:
            pass
        deadline = time.monotonic() + max(0.0, grace_s)
        while time.monotonic() < deadline:
            if self._dom(handle.ref) is None or not dom.isActive():
                return
            time.sleep(0.1)
        try:
            dom.destroy()
        except self._libvirt.libvirtError:
            pass  # already gone

    def list_own(self) -> list[tuple[str, int, SandboxHandle]]:
        out = []
        for dom in self.conn.listAllDomains():
            try:
                md = ET.fromstring(dom.metadata(self._libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS))
            except (self._libvirt.libvirtError, ET.ParseError):
                continue  # not ours
            if md.get("node") != self.node:
                continue
            job_id, attempt = md.get("job"), int(md.get("attempt"))
            out.append((job_id, attempt, SandboxHandle(
                driver=self.name, ref=dom.name(), job_id=job_id, attempt=attempt,
                started_at=float(md.get("started_at") or time.time()),
                time_limit_s=float(md.get("time_limit_s") or 0) or None,
                gpu_indexes=[int(i) for i in (md.get("gpus") or "").split(",") if i])))
        return out

    def remove(self, handle: SandboxHandle) -> None:
        dom = self._dom(handle.ref)
        if dom is not None:
            try:
                if dom.isActive():
                    dom.destroy()
                if dom.isPersistent():
                    dom.undefine()
            except self._libvirt.libvirtError as exc:
                log.warning("could not remove VM %s: %s", handle.ref, exc)
        try:
            os.unlink(self.log_dir / f"{handle.ref}.log")
        except FileNotFoundError:
            pass
