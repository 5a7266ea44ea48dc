"""The libvirt domain of one job attempt (``domain_xml``), and the host checks around it: what a GPU's PCI
address holds (``check_gpu``), whether KVM really works (``kvm_works``), and the agent's private state
folders (``private_dir``, ``driver_dir``). Used by ``agents/sandbox/kvm_driver.py``; the process driver keeps
its jobs' folders and exit records in a ``driver_dir`` too."""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from agents.sandbox import LaunchSpec, SandboxError, sandbox_name

METADATA_NS = "https://gpuportal.dev/xmlns/agent/1"
ET.register_namespace("gpuportal", METADATA_NS)
_PCI_RE = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
# The guest's own share on top of the job's memory (which its cgroup caps) and the image: kernel, init, caches.
GUEST_MEMORY_MB = 96
# Kernel command line: serial console, no boot chatter, power off (not reboot) on panic, two serial ports
# (the console and the exit code's), and a ramfs root (a tmpfs one holds at most half the memory; the image
# lives there).
CMDLINE = "console=ttyS0 quiet panic=-1 8250.nr_uarts=2 rootfstype=ramfs"
# CFS period for the domain's CPU cap (libvirt <cputune>).
CPU_PERIOD_US = 100_000


def pci_address(bus_id: str) -> dict[str, str]:
    """NVML's "00000000:3B:00.0" -> libvirt's domain/bus/slot/function attributes (the whole domain:
    hosts with VMD or many root complexes use domains above 0xffff)."""
    m = _PCI_RE.match(bus_id.strip())
    if not m:
        raise SandboxError(f"not a PCI bus id: {bus_id!r}")
    dom, bus, slot, fn = m.groups()
    return {"domain": f"0x{int(dom or '0', 16):04x}", "bus": f"0x{int(bus, 16):02x}",
            "slot": f"0x{int(slot, 16):02x}", "function": f"0x{int(fn, 16):x}"}


def check_gpu(bus_id: str, sysfs: str = "/sys/bus/pci/devices") -> None:
    """SandboxError unless the device at ``bus_id`` is an NVIDIA display controller (vendor 0x10de, class
    0x03xx): never hand a VM whatever else sits at an address (a NIC, a disk controller)."""
    a = pci_address(bus_id)
    name = f"{int(a['domain'], 16):04x}:{a['bus'][2:]}:{a['slot'][2:]}.{a['function'][2:]}"
    try:
        vendor = (Path(sysfs) / name / "vendor").read_text().strip().lower()
        klass = (Path(sysfs) / name / "class").read_text().strip().lower()
    except OSError:
        raise SandboxError(f"no PCI device {name} on this host (GPU bus id {bus_id!r})") from None
    if vendor != "0x10de" or not klass.startswith("0x03"):
        raise SandboxError(f"PCI device {name} is not an NVIDIA GPU (vendor {vendor}, class {klass}): "
                           f"refusing to pass it through")


def domain_xml(spec: LaunchSpec, *, node: str, pci_bus_ids: list[str], kernel: str, initrd: str,
               console_log: str, domain_type: str = "kvm", started_at: float | None = None,
               job_network: str | None = None, extra_memory_mb: int = 0, name: str | None = None,
               qemu_user: tuple[int, int] | None = None, exit_log: str | None = None, installation: str = "",
               terminal_socket: str | None = None, filesystems: list[tuple] = ()) -> str:
    """The libvirt domain for one job attempt.

    ``qemu_user`` (uid, gid): QEMU runs as this user instead of libvirt's
    shared one (libvirt hands it the kernel, initrd and its own files).

    ``extra_memory_mb`` goes on top of the job's memory: the guest holds its
    image (unpacked) and, while booting, the initrd in RAM. The job itself
    gets no more than its ``memory_mb`` (a cgroup in the guest), and its
    CPU time is capped on the host at ``cpus`` (``<cputune>``), on
    ``ceil(cpus)`` vCPUs. ``exit_log`` is the second serial port's file. ``terminal_socket``: a third
    serial port on a unix socket libvirt makes, where the guest serves the job's terminal session.

    No NIC unless the job may use the network; then one virtio NIC on
    ``job_network`` (a libvirt network name; ``"user"`` is QEMU's user-mode
    NAT), or still none when the node has no job network. ``filesystems``: host folders
    the guest mounts over virtio-9p, ``(folder, tag, read_only)``. A read-only one is shared in
    libvirt's ``squash`` mode (the guest sees the host's owners and modes: 0444 files, 0555
    folders); a writable one in ``mapped`` mode: QEMU's uid owns every file on the host (0600,
    folders 0700) and keeps the guest's owner, mode and file type in ``user.virtfs.*`` extended
    attributes, so the job owns what it makes there, and what it makes a symlink or a device is a
    plain file on the host. A fourth item names another libvirt mode: ``passthrough`` for a
    project volume, whose files must belong on the host to the uid/gid QEMU runs as (``qemu_user``,
    the project's; the guest's job runs as the same uid, so QEMU's chown to it succeeds, and any
    other owner fails). Memory is locked
    when GPUs are passed through, because VFIO DMA needs pinned guest memory.
    """
    d = ET.Element("domain", type=domain_type)
    ET.SubElement(d, "name").text = name or sandbox_name(spec.job_id, spec.attempt)
    md = ET.SubElement(ET.SubElement(d, "metadata"), f"{{{METADATA_NS}}}job", {
        "job": spec.job_id, "attempt": str(spec.attempt), "node": node,
        "time_limit_s": str(spec.time_limit_s), "gpus": ",".join(map(str, spec.gpu_indexes)),
        "started_at": f"{time.time() if started_at is None else started_at:.3f}"})
    if qemu_user:
        md.set("qemu_uid", str(qemu_user[0]))
    if installation:
        md.set("installation", installation)
    # For reconcile and people reading `virsh dumpxml`; the guest gets its command from the initrd.
    md.text = json.dumps({"command": spec.command, "image": spec.image})
    ET.SubElement(d, "memory", unit="MiB").text = str(spec.memory_mb + GUEST_MEMORY_MB + extra_memory_mb)
    ET.SubElement(d, "vcpu").text = str(max(1, math.ceil(spec.cpus)))
    tune = ET.SubElement(d, "cputune")  # the whole domain (every vCPU and QEMU's own threads) together
    ET.SubElement(tune, "global_period").text = str(CPU_PERIOD_US)
    ET.SubElement(tune, "global_quota").text = str(max(1000, int(spec.cpus * CPU_PERIOD_US)))
    os_ = ET.SubElement(d, "os")
    ET.SubElement(os_, "type", arch="x86_64", machine="q35").text = "hvm"
    ET.SubElement(os_, "kernel").text = kernel
    ET.SubElement(os_, "initrd").text = initrd
    cmdline = CMDLINE.replace("8250.nr_uarts=2", "8250.nr_uarts=3") if terminal_socket else CMDLINE
    ET.SubElement(os_, "cmdline").text = f"{cmdline} gpuportal.job={spec.job_id}"
    feats = ET.SubElement(d, "features")
    ET.SubElement(feats, "acpi")  # without it poweroff never ends the domain (docs/sandboxes.md section 2)
    if spec.gpu_uuids:
        # Older NVIDIA drivers refuse to start when they see a hypervisor.
        ET.SubElement(ET.SubElement(feats, "kvm"), "hidden", state="on")
        ET.SubElement(ET.SubElement(d, "memoryBacking"), "locked")
    if domain_type == "kvm":
        ET.SubElement(d, "cpu", mode="host-passthrough")
    for ev in ("on_poweroff", "on_reboot", "on_crash"):
        ET.SubElement(d, ev).text = "destroy"
    dev = ET.SubElement(d, "devices")
    # The console goes to a plain file that libvirt opens: it holds every byte from the first one
    # (a pty drops what nobody reads), and the agent reads it without a libvirt stream.
    serial = ET.SubElement(dev, "serial", type="file")
    ET.SubElement(serial, "source", path=console_log, append="off")
    ET.SubElement(serial, "target", port="0")
    ET.SubElement(ET.SubElement(dev, "console", type="file"), "target", type="serial", port="0")
    if exit_log:
        exit_port = ET.SubElement(dev, "serial", type="file")
        ET.SubElement(exit_port, "source", path=exit_log, append="off")
        ET.SubElement(exit_port, "target", port="1")
    if terminal_socket:
        term = ET.SubElement(dev, "serial", type="unix")
        ET.SubElement(term, "source", mode="bind", path=terminal_socket)
        ET.SubElement(term, "target", port="2")
    if spec.network and job_network:
        if job_network == "user":
            nic = ET.SubElement(dev, "interface", type="user")
        else:
            nic = ET.SubElement(dev, "interface", type="network")
            ET.SubElement(nic, "source", network=job_network)
        ET.SubElement(nic, "model", type="virtio")
    for folder, tag, read_only, *mode in filesystems:
        fs = ET.SubElement(dev, "filesystem", type="mount",
                           accessmode=mode[0] if mode else "squash" if read_only else "mapped")
        ET.SubElement(fs, "driver", type="path")
        ET.SubElement(fs, "source", dir=folder)
        ET.SubElement(fs, "target", dir=tag)
        if read_only:
            ET.SubElement(fs, "readonly")
    for bus_id in pci_bus_ids:
        hd = ET.SubElement(dev, "hostdev", mode="subsystem", type="pci", managed="yes")
        ET.SubElement(hd, "driver", name="vfio")
        ET.SubElement(ET.SubElement(hd, "source"), "address", pci_address(bus_id))
        ET.SubElement(hd, "rom", bar="off")
    ET.SubElement(dev, "controller", type="usb", model="none")
    ET.SubElement(dev, "memballoon", model="none")
    if qemu_user:
        sec = ET.SubElement(d, "seclabel", type="static", model="dac", relabel="yes")
        ET.SubElement(sec, "label").text = f"+{qemu_user[0]}:+{qemu_user[1]}"
    return ET.tostring(d, encoding="unicode")


def kvm_works(conn=None) -> tuple[bool, str]:
    """Whether libvirt domains of type 'kvm' can run a stock kernel here, and why (not)."""
    if not os.path.exists("/dev/kvm"):
        return False, "/dev/kvm does not exist"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not readable and writable"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return False, ("/dev/kvm is PVM (module kvm_pvm), which runs only PVM-built guest kernels: "
                       "a stock kernel hangs or hits 'KVM internal error ... emulation failure'")
    hw = [m for m in ("kvm_intel", "kvm_amd") if os.path.isdir(f"/sys/module/{m}")]
    if not hw:
        return False, "neither kvm_intel nor kvm_amd is loaded"
    if conn is not None:
        try:
            conn.getDomainCapabilities(None, "x86_64", None, "kvm", 0)
        except Exception as exc:  # libvirtError
            return False, f"libvirt cannot run kvm domains: {exc}"
    return True, f"{hw[0]} is loaded and libvirt offers kvm domains"


# The agent's own folder (``--state-dir``, GPUPORTAL_AGENT_STATE_DIR) when it runs as root; another user's agent
# (a laptop's ``make run``) keeps it under its home instead, where it can make it.
DEFAULT_STATE_DIR = "/var/lib/gpuportal-agent"


def agent_state_dir(state_dir: str | os.PathLike | None = None) -> Path:
    """``state_dir``, else GPUPORTAL_AGENT_STATE_DIR, else DEFAULT_STATE_DIR (root) or
    ``$XDG_STATE_HOME/gpuportal-agent`` (``~/.local/state``) for another user."""
    if state_dir or os.environ.get("GPUPORTAL_AGENT_STATE_DIR"):
        return Path(state_dir or os.environ["GPUPORTAL_AGENT_STATE_DIR"])
    if os.geteuid() == 0:
        return Path(DEFAULT_STATE_DIR)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "gpuportal-agent"


def driver_dir(kind: str, node: str, state_dir: str | os.PathLike | None = None, mode: int = 0o700) -> Path:
    """A driver's private folder for ``node`` in the agent's state folder: ``<state>/<kind>-<node>``."""
    return private_dir(agent_state_dir(state_dir) / f"{kind}-{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}", mode)


def private_dir(path: Path, mode: int = 0o711) -> Path:
    """``path`` as a folder only this agent controls, made if missing; SandboxError if it cannot be.

    Like OpenSSH's StrictModes: every folder on the way is root's or ours and
    writable by nobody else (or sticky, as /tmp), a symlink on the way is
    root's or ours, and ``path`` itself is a real folder (never followed)
    of ours with mode 0700 or 0711: nobody else can list it, put a file or a
    link in it, or swap it. A new one gets ``mode``: 0711 for the kvm driver
    (QEMU, under a uid of its own, opens the files libvirt gives it there),
    0700 where nobody else needs in.
    """
    path = Path(os.path.abspath(path))
    me = os.geteuid()
    cur = Path("/")
    for part in path.parts[1:-1]:
        cur = cur / part
        try:
            os.mkdir(cur, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise SandboxError(f"cannot make the agent's state folder {cur}: {exc}") from None
        st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, me):
                raise SandboxError(f"refusing state folder {path}: {cur} is a symlink of uid {st.st_uid}")
            cur = Path(os.path.realpath(cur))
            st = os.lstat(cur)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, me) or (
                st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise SandboxError(f"refusing state folder {path}: {cur} is not a folder that only root or this "
                               f"agent can change (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    target = cur / path.name
    try:
        os.mkdir(target, mode)
        os.chmod(target, mode)  # whatever the umask
    except FileExistsError:
        pass
    st = os.lstat(target)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or stat.S_IMODE(st.st_mode) not in (0o700, 0o711):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode) \
            else f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
        raise SandboxError(f"refusing state folder {target}: it is {kind}; it must be a folder of uid {me} "
                           f"with mode 0700 or 0711 (remove it, the agent makes it)")
    return target


def create_private(path: Path):
    """A new file of ours, mode 0600: whatever lay at ``path`` goes first, and a link is never followed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "wb")
