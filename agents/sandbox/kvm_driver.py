"""KVM sandbox through libvirt: one transient VM per job attempt, its GPUs
passed through whole by PCI address (VFIO).

The guest is the project's own boot image (``agents/sandbox/kvm_image.py``:
a Debian kernel plus a busybox initramfs, cached in ``var/kvm``) with the job's
image unpacked under ``/image``. Images come from the node's Docker engine, as
for the docker sandbox (no registry is reachable; CI makes them with
``docker import``): the driver resolves ``spec.image`` to its id and converts
each id once to a gzip'd cpio (``<image_dir>/images/<id>.cpio.gz``, from
``docker create`` + ``export``; the container never starts). Per launch it
concatenates the initramfs, that cpio and the job's command and environment
(``kvm_image.job_overlay``) and starts a transient domain (``createXML``). The
guest's init prints ``GPUPORTAL-JOB-START``, runs the command chrooted into the
image as uid/gid 65534 with its output on the serial console, prints
``GPUPORTAL-JOB-EXIT rc=N`` and powers off, which ends the domain. libvirt
writes the serial console to ``<state_dir>/<name>.log`` (``kvm_console``
joins virtlogd's rotations); ``read_logs`` returns only what lies between the
two markers (no kernel noise). ``poll`` reads the exit code once the domain is
gone, from the second serial port (``<name>.exit``), which only init can
write: the job writes the console, so a marker there proves nothing. A record
per attempt (``<name>.json``, written before its VM starts) outlives the VM:
an attempt whose VM ended while the agent was down is adopted from it, its
real exit code reported once, then its files go (``list_own``, ``remove``).

Each VM's QEMU runs under a uid of its own (``GPUPORTAL_KVM_VM_UIDS``);
per-launch files (a copy of the kernel, the initrd with the job's
environment, the console) live in a folder only the agent controls
(``kvm_domain.driver_dir``). A job with network reaches the public internet
only: QEMU's user-mode network makes the guest's connections the VM uid's
sockets on the node, and the egress policy (``egress.py``) matches that uid.

As in Docker, the image's ``Entrypoint`` goes before the command and its
``Env`` under the job's (``PATH`` is the image's); its ``User`` and
``WorkingDir`` are not used (65534 in a tmpfs ``/work``, as in the docker
sandbox). The guest holds the whole image in RAM (a ramfs root: the kernel's
default tmpfs root would take at most half of it), so the domain gets the
image's size and the initrd's on top of the job's memory; the job itself is
held to its memory in a guest cgroup. Images over ``GPUPORTAL_KVM_MAX_IMAGE_MB``
(2 GiB) are refused.

Domain type: ``kvm`` only when KVM really works here (a hardware-virtualisation
module, not PVM, and libvirt agrees); otherwise libvirt's ``qemu`` type (TCG,
software emulation, a few seconds per boot), and the driver says so in its log
(docs/sandboxes.md section 2: /dev/kvm on the development machines is
PVM, which hangs stock kernels). GPUs pass through by VFIO; the development
machines have no VFIO, so only the XML is tested there.

Needs ``libvirt-python`` (and libvirtd for ``qemu:///system``; .ci/kvm.sh);
imported lazily so the rest of the agent runs without it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import requests

from agents import supervisor
from agents.sandbox import (
    EXITED, OOM, RUNNING, LaunchSpec, SandboxError, SandboxHandle, job_env, sandbox_name, uid_range,
)
from agents.sandbox import kvm_image
from agents.sandbox.egress import EgressError, Firewall, parse_allow
from agents.sandbox.kvm_console import console_files, read_console
from agents.sandbox.kvm_domain import (
    METADATA_NS, check_gpu, create_private, domain_xml, driver_dir, kvm_works, private_dir,
)
from agents.sandbox.kvm_image import EXIT_MARKER, JOB_UID, START_MARKER
from agents.sandbox.volumes import VolumePathError, plan_mounts, project_uid
from agents.supervisor.lease import FENCED, forget_fenced, was_fenced

log = logging.getLogger(__name__)

EXIT_RE = re.compile(re.escape(EXIT_MARKER) + rb"(\d+)")
# What init writes on the second serial port, which the job cannot open.
EXIT_RECORD_RE = re.compile(rb"GPUPORTAL-JOB-EXIT rc=(\d+) oom_kill=(\d+)")
MiB = 2**20
# The largest job image (uncompressed, as `docker image inspect` says) a VM may unpack into its memory.
MAX_IMAGE_MB = 2048
# Converted images kept in the cache beyond the ones still on the engine: the least recently used go first.
IMAGE_CACHE_MB = 20480
# Bounds of one image's conversion (files and folders; seconds, export included): a launch waits for it.
MAX_IMAGE_ENTRIES = 500_000
CONVERT_TIMEOUT_S = 900
# Docker's PATH for an image that sets none.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Each VM's QEMU runs under a uid of its own from this range (never libvirt's shared qemu user): one QEMU
# cannot touch another's memory or files, and the egress policy matches a VM's traffic by its uid. Two
# agents on one host need disjoint ranges.
VM_UIDS = "3900000-3999999"
# The projects' uids (= gids), as the docker sandbox's: a VM that mounts a project's volumes runs its QEMU
# as the project's uid, so that what the job writes there is the project's on the node.
JOB_UIDS = "2000000-2999999"
# libvirt's folder of per-domain folders: such a QEMU (not in libvirt's group) passes through it to its own.
LIBVIRT_QEMU_DIR = "/var/lib/libvirt/qemu"


@dataclass
class JobImage:
    cpio: Path  # the image's root filesystem, every path under /image
    size: int  # bytes, uncompressed
    env: list[str]  # "NAME=value", from the image's config
    entrypoint: list[str]


class KvmDriver:
    name = "kvm"

    def __init__(self, *, node: str, uri: str = "qemu:///system", domain_type: str = "auto",
                 kernel: str | None = None, initrd: str | None = None, image_dir: str | None = None,
                 state_dir: str | None = None, pci_bus_ids: dict[int, str] | None = None,
                 job_network: str | None = "user", docker_client=None, max_image_mb: int | None = None,
                 image_cache_mb: int | None = None, vm_uids: str | None = None,
                 egress_allow: str | list[str] | None = None, installation: str | None = None,
                 max_image_entries: int | None = None, convert_timeout_s: int | None = None,
                 supervise: bool = False, volumes_root: str | None = None, job_uids: str | None = None):
        try:
            import libvirt
        except ImportError as exc:
            raise SandboxError("the kvm sandbox needs libvirt-python (pip install libvirt-python)") from exc
        self._libvirt = libvirt
        # libvirt's default handler prints every error to stderr, "Domain not found" for each look at a
        # VM that has ended included; the driver turns the ones that matter into SandboxError.
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        self.node = node
        # Several installations may share one libvirtd: names and adoption go by installation and node.
        self.installation = installation if installation is not None else os.environ.get("GPUPORTAL_INSTALLATION", "")
        img_dir = Path(image_dir) if image_dir else Path(initrd).parent if initrd else kvm_image.DEFAULT_DIR
        self._stale = None
        if kernel is None or initrd is None:
            try:
                m = json.loads((img_dir / "manifest.json").read_text())
                kernel, initrd = kernel or m["kernel"], initrd or m["initrd"]
                if m.get("build_version") != kvm_image.BUILD_VERSION:
                    # An older /init would run the job without its image's /proc, /dev and /work.
                    self._stale = (f"the VM image in {img_dir} is of build {m.get('build_version')}, this agent "
                                   f"needs build {kvm_image.BUILD_VERSION}")
            except (OSError, ValueError, KeyError):
                kernel, initrd = kernel or str(img_dir / "vmlinux"), initrd or str(img_dir / "initramfs.cpio.gz")
        self.kernel, self.initrd = kernel, initrd
        # Job images as cpio, one per image id; created on first use (the Docker engine too).
        self.image_cache = img_dir / "images"
        self.max_image_mb = max_image_mb or _env_mb("GPUPORTAL_KVM_MAX_IMAGE_MB", MAX_IMAGE_MB)
        self.image_cache_mb = image_cache_mb or _env_mb("GPUPORTAL_KVM_IMAGE_CACHE_MB", IMAGE_CACHE_MB)
        self.max_image_entries = max_image_entries or _env_mb("GPUPORTAL_KVM_MAX_IMAGE_ENTRIES", MAX_IMAGE_ENTRIES,
                                                              unit="entries")
        self.convert_timeout_s = convert_timeout_s or _env_mb("GPUPORTAL_KVM_CONVERT_TIMEOUT_S", CONVERT_TIMEOUT_S,
                                                              unit="seconds")
        # Launches in progress, by (job, attempt): a stop sets the event and ends an image conversion.
        self._cancels: dict[tuple[str, int], threading.Event] = {}
        self._docker = docker_client
        self.job_network = job_network
        # Per-launch files (the initrd with the job's environment, the kernel, the console) live in a folder
        # of this node's under the agent's state dir, never in a shared predictable path.
        self.state_dir = driver_dir("kvm", node, state_dir, mode=0o711)
        self.log_dir = self.state_dir  # the consoles are there too
        # supervise (the agent sets it): each VM gets a supervisor process that outlives the agent and
        # destroys it when the node's lease file runs out (agents/supervisor/, as the docker sandbox's).
        self.lease_path = self.state_dir / "lease" if supervise else None
        self.lease_s, self.fence_grace_s = 60.0, 3.0
        self._supervisors: dict[str, subprocess.Popen] = {}
        # QEMU runs under a uid of its own: libvirt hands it the per-job kernel and initrd by ownership,
        # but every folder above them must let it through (the driver's own is 0711, never listable).
        blocked = [str(p) for p in [self.state_dir, *self.state_dir.parents] if not p.stat().st_mode & 0o001]
        if blocked and not uri.startswith("test:"):
            log.warning("kvm sandbox: %s is not searchable by other users: QEMU (it runs as a uid of its own) "
                        "cannot open the VM's kernel and initrd under %s", blocked[0], self.state_dir)
        self.vm_uids = uid_range(vm_uids or os.environ.get("GPUPORTAL_KVM_VM_UIDS") or VM_UIDS, "GPUPORTAL_KVM_VM_UIDS")
        # The operator's tree of project volumes (docs/storage.md), and the projects' uids on this node.
        self.volumes_root = volumes_root if volumes_root is not None else os.environ.get("GPUPORTAL_VOLUMES_ROOT", "")
        self.job_uids = uid_range(job_uids or os.environ.get("GPUPORTAL_JOB_UIDS") or JOB_UIDS, "GPUPORTAL_JOB_UIDS")
        self._uid_lock = threading.Lock()
        self._uids_starting: set[int] = set()
        # The group that lets QEMU into libvirt's per-domain folders (libvirt's own qemu group).
        try:
            self.vm_gid = os.stat(LIBVIRT_QEMU_DIR).st_gid
        except OSError:
            self.vm_gid = 0
        # Jobs with network: QEMU's user-mode network turns the guest's connections into the node's own
        # sockets (10.0.2.2 is the node's 127.0.0.1), so the egress policy must hold before any such job.
        try:
            allow = parse_allow(egress_allow if egress_allow is not None
                                else os.environ.get("GPUPORTAL_EGRESS_ALLOW", ""))
        except EgressError as exc:
            raise SandboxError(str(exc)) from None
        lo, hi = self.vm_uids
        hooks = [("OUTPUT", ["-m", "owner", "--uid-owner", f"{lo}-{hi}"])]
        if self.volumes_root:  # a VM with the project's volumes: its QEMU (and user-mode network) is the project's uid
            hooks.append(("OUTPUT", ["-m", "owner", "--uid-owner", "{}-{}".format(*self.job_uids)]))
        self.firewall = Firewall(chain=f"GPUPORTAL-KVM-{lo}", allow=allow, hooks=hooks)
        self._egress_problem: str | None = None
        if job_network == "user" and not uri.startswith("test:"):
            self._egress_problem = self._install_egress()
        # GPU index -> PCI bus id, from the probe's inventory (set by the caller).
        self.pci_bus_ids = dict(pci_bus_ids or {})
        try:
            self.conn = libvirt.open(uri)
        except libvirt.libvirtError as exc:
            raise SandboxError(f"libvirt at {uri} is not answering: {exc}") from exc
        self._auto = domain_type == "auto"
        if self._auto:
            ok, why = kvm_works(self.conn)
            if ok:
                self.domain_type = "kvm"
                log.info("kvm sandbox: libvirt domain type 'kvm' (%s)", why)
            else:
                self.domain_type = "qemu"
                log.warning("kvm sandbox: KVM does not work here (%s); falling back to libvirt domain type "
                            "'qemu' (TCG software emulation: jobs run, several times slower)", why)
        else:
            self.domain_type = domain_type
        self.prune_records()
        if not uri.startswith("test:"):
            self.prune_image_cache()  # what an earlier run left: dropped images, a crash's leftovers
            log.info("kvm sandbox: libvirt domain type %r (configured)", domain_type)

    # -- Driver interface -----------------------------------------------------

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        try:
            buses = [self.pci_bus_ids[i] for i in spec.gpu_indexes]
        except KeyError as exc:
            raise SandboxError(f"no PCI address known for GPU {exc.args[0]}") from None
        vcpus, node_cpus = math.ceil(spec.cpus), self.conn.getInfo()[2]
        if vcpus > node_cpus:
            raise SandboxError(f"cpus: {spec.cpus:g} needs {vcpus} vCPUs, node {self.node} has {node_cpus} CPUs")
        if self.domain_type != "test":
            for bus in buses:
                check_gpu(bus)
        name = self.vm_name(spec)
        if self._dom(name) is not None:
            raise SandboxError(f"VM {name} already exists")
        if spec.network and self.job_network == "user" and not self.conn.getURI().startswith("test:"):
            self._check_egress()
        console = self.state_dir / f"{name}.log"
        cancel = self._cancels.setdefault((spec.job_id, spec.attempt), threading.Event())
        volumes, checkpoint_dir, owner = self._volumes(spec)
        uid = owner if owner is not None else self._claim_uid()
        try:
            shares = self._shares(spec, name, uid, volumes)
            kernel, initrd, extra_mb = self._job_files(spec, name, cancel, shares, owner, checkpoint_dir)
            if cancel.is_set():
                raise SandboxError("stopped while its VM was being prepared")
            started = time.time()
            # A stale console or exit record from an earlier VM of this name must not be read as this one's.
            self._remove_console(name)
            try:
                # Before the VM: a VM that ends while the agent is down leaves no domain to find, only this.
                self._write_record(spec, name, started)
                self._create(spec, name, buses, kernel, initrd, console, started, extra_mb, uid, shares,
                             gid=self.vm_gid if owner is None else owner)
            except (SandboxError, OSError) as exc:
                self._remove_console(name)  # a failed start's console and exit files are litter too
                shutil.rmtree(self._outputs_root(name), ignore_errors=True)  # nothing ran: no outputs
                _unlink(self._record_path(name))
                if isinstance(exc, OSError):  # the record could not be written (a full disk)
                    raise SandboxError(f"could not write the VM's record on node {self.node}: {exc}") from None
                raise
            finally:
                # QEMU has read them into guest memory by now (or the start failed): they are litter.
                for f in (kernel, initrd):
                    if f not in (self.kernel, self.initrd):
                        _unlink(f)
        except SandboxError:
            shutil.rmtree(self._outputs_root(name), ignore_errors=True)
            raise
        finally:
            with self._uid_lock:  # the live domain's metadata holds it from now on
                self._uids_starting.discard(uid)
            self._cancels.pop((spec.job_id, spec.attempt), None)
        log.info("job %s attempt %s: VM %s started (domain type %s)", spec.job_id, spec.attempt, name,
                 self.domain_type)
        if self.lease_path is not None:
            self._supervisors[name] = supervisor.start("kvm", name, self.lease_path, self.lease_s,
                                                       self.fence_grace_s, "--uri", self.conn.getURI())
        return SandboxHandle(driver=self.name, ref=name, job_id=spec.job_id, attempt=spec.attempt,
                             started_at=started, time_limit_s=spec.time_limit_s,
                             gpu_indexes=list(spec.gpu_indexes))

    def cancel_launch(self, job_id: str, attempt: int) -> None:
        """A stop that overtook this attempt's launch: end its image conversion, start no VM."""
        ev = self._cancels.get((str(job_id), int(attempt)))
        if ev is not None:
            ev.set()

    def vm_name(self, spec: LaunchSpec) -> str:
        """The domain's name: unique per node and job attempt, so agents sharing one libvirtd never collide."""
        return sandbox_name(spec.job_id, spec.attempt, scope="-".join(filter(None, (self.installation, self.node))))

    def _check_egress(self) -> None:
        """Refuse a job with network unless the egress policy is in force (it may have been flushed)."""
        if self._egress_problem is None and not self.firewall.installed():
            log.warning("kvm sandbox: the egress policy %s was removed from the node's firewall; "
                        "installing it again", self.firewall.chain)
            self._egress_problem = self._install_egress()
        if self._egress_problem:
            raise SandboxError(f"jobs with network cannot run on node {self.node}: its egress policy "
                               f"cannot be enforced ({self._egress_problem})")

    def _install_egress(self) -> str | None:
        try:
            self.firewall.install()
            return None
        except EgressError as exc:
            log.error("kvm sandbox: egress policy not installed, jobs with network are refused: %s", exc)
            return str(exc)

    def _claim_uid(self) -> int | None:
        """A uid of the range that no live VM of ours and no other launch uses now."""
        if self.domain_type == "test":
            return None
        lo, hi = self.vm_uids
        with self._uid_lock:
            used = set(self._uids_starting)
            for dom in self.conn.listAllDomains():
                try:
                    md = ET.fromstring(dom.metadata(self._libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS))
                    used.add(int(md.get("qemu_uid")))
                except (self._libvirt.libvirtError, ET.ParseError, TypeError, ValueError):
                    continue
            uid = next((u for u in range(lo, hi + 1) if u not in used), None)
            if uid is None:
                raise SandboxError(f"node {self.node} runs {hi - lo + 1} VMs, every uid of its range {lo}-{hi}")
            self._uids_starting.add(uid)
            return uid

    def _volumes(self, spec: LaunchSpec) -> tuple[list[tuple[str, str, bool]], str | None, int | None]:
        """The project volumes and checkpoint folder this launch mounts (``plan_mounts``: host folder,
        guest path, read-only; made and given to the project's uid first), the checkpoint folder's
        path in the guest, and the project's uid (= gid), under which the VM's QEMU then runs: None
        (a VM uid of its own) when it mounts none. A job names no checkpoint folder where the node
        has no volumes root, as in the docker sandbox."""
        if self.domain_type == "test" or spec.project_id is None and not spec.volumes:
            return [], None, None
        if spec.project_id is None:  # QEMU would write them as a uid of no project
            raise SandboxError("volumes: the launch names no project, whose uid the volumes' files need")
        try:
            owner = project_uid(spec.project_id, self.job_uids)
            binds, checkpoint_dir, _ = plan_mounts(self.volumes_root, spec.volumes, spec.checkpoint, owner=owner)
        except (VolumePathError, OSError) as exc:
            raise SandboxError(f"volumes: {exc}") from None
        if binds:
            self._check_searchable(Path(os.path.realpath(self.volumes_root)))
        return binds, checkpoint_dir, (owner if binds else None)

    def _check_searchable(self, volumes_root: Path) -> None:
        """SandboxError unless QEMU, as a project's uid (in no group of the node's), can pass through
        libvirt's folder to its domain's own and through the volumes root's folders to the project's."""
        for path in [Path(LIBVIRT_QEMU_DIR), volumes_root, *volumes_root.parents]:
            try:
                blocked = not os.stat(path).st_mode & 0o001
            except OSError:
                blocked = False  # another layout: libvirt says what fails
            if blocked:
                raise SandboxError(f"volumes: node {self.node} cannot run a VM as its project's uid: {path} is not "
                                   f"searchable by other users (chmod o+x it; .ci/kvm.sh does for {LIBVIRT_QEMU_DIR})")

    def _shares(self, spec: LaunchSpec, name: str, uid: int | None,
                volumes: list[tuple[str, str, bool]] = ()) -> list[tuple]:
        """The host folders the guest mounts over virtio-9p, ``(host folder, tag, read_only, mount point
        below /image)``: each dataset's folder in the node's cache read-only at /datasets/<name> (files
        0444, folders 0555: QEMU's uid reads them, nobody writes), and this attempt's /outputs.

        /outputs is ``<state>/outputs/<vm>/outputs``: its parent belongs to the VM's QEMU uid, mode 0700
        (no other host user gets in), and the folder itself is 0777 so that the job (uid 65534 in the
        guest, which checks the modes it is shown) may write it. QEMU shares it in libvirt's ``mapped``
        mode (kvm_domain.domain_xml): what the job writes belongs to QEMU's uid on the node (its own
        uid and modes kept in extended attributes), and a symlink it makes is a plain file holding the
        target's name there, never a link; the agent (root) reads it without following any link
        (agents/artifacts.py). The folder must be on a file system with user extended attributes.

        Project volumes and the checkpoint folder (``volumes``) in libvirt's ``passthrough`` mode:
        QEMU runs as the project's uid/gid then, so what the job (the same uid in the guest) writes
        there is the project's on the node, as from the docker sandbox; QEMU resolves every path
        below the share without following a link out, and the node's permissions hold it to the
        project's files whatever the guest asks."""
        shares = [(path, f"ds{i}", True, f"datasets/{ds}") for i, (ds, path) in
                  enumerate(sorted(spec.dataset_paths.items()))]
        shares += [(host, f"vol{i}", ro, guest.lstrip("/"), "passthrough")
                   for i, (host, guest, ro) in enumerate(volumes)]
        if spec.outputs and self.domain_type != "test":
            root = self._outputs_root(name)
            try:
                private_dir(root.parent, 0o711)
                shutil.rmtree(root, ignore_errors=True)  # an earlier start of this attempt that failed
                root.mkdir(mode=0o700)
                (root / "outputs").mkdir(mode=0o777)
                os.chmod(root / "outputs", 0o777)  # past the umask
                if uid is not None:
                    for p in (root, root / "outputs"):
                        os.chown(p, uid, uid if volumes else self.vm_gid)
            except OSError as exc:
                raise SandboxError(f"could not make the job's outputs folder on node {self.node}: {exc}") from None
            shares.append((str(root / "outputs"), "outputs", False, "outputs"))
        return shares

    def _outputs_root(self, name: str) -> Path:
        return self.state_dir / "outputs" / name

    def outputs_dir(self, handle: SandboxHandle) -> str | None:
        """The host folder of the job's /outputs (agents/artifacts.py), None when it has none."""
        folder = self._outputs_root(handle.ref) / "outputs"
        return str(folder) if folder.is_dir() else None

    def _create(self, spec, name, buses, kernel, initrd, console, started, extra_mb, uid, shares=(), gid=None):
        libvirt = self._libvirt
        while True:
            xml = domain_xml(spec, node=self.node, pci_bus_ids=buses, kernel=kernel, initrd=initrd,
                             console_log=str(console), exit_log=str(console.with_suffix(".exit")),
                             domain_type=self.domain_type, started_at=started,
                             job_network=self.job_network, extra_memory_mb=extra_mb, name=name,
                             installation=self.installation,
                             filesystems=[(sh[0], sh[1], sh[2], *sh[4:]) for sh in shares],
                             qemu_user=None if uid is None else (uid, self.vm_gid if gid is None else gid),
                             terminal_socket=self._terminal_socket(name) if _has_terminal(spec) else None)
            try:
                self.conn.createXML(xml, 0)
                return
            except libvirt.libvirtError as exc:
                msg = exc.get_error_message()
                if self._auto and self.domain_type == "kvm" and "kvm" in msg.lower():
                    log.warning("kvm sandbox: libvirt refused a kvm domain (%s); falling back to domain "
                                "type 'qemu' (TCG software emulation) from now on", msg)
                    self.domain_type = "qemu"
                    continue
                if exc.get_error_code() == libvirt.VIR_ERR_OPERATION_FAILED and "already exists" in msg:
                    raise SandboxError(f"VM {name} already exists") from None
                raise SandboxError(f"could not start the VM: {msg}") from None

    def _job_files(self, spec: LaunchSpec, name: str, cancel: threading.Event | None = None,
                   shares=(), owner: int | None = None, checkpoint_dir: str | None = None) -> tuple[str, str, int]:
        """This launch's own kernel and initrd (the initramfs, the job's image and its command and
        environment in one file), and the MiB the guest needs for them on top of the job's memory.

        The kernel is a copy too: libvirt gives each file to the VM's QEMU uid while it starts, and refuses
        to give one file to two uids at once.
        """
        if self.domain_type == "test":
            return self.kernel, self.initrd, 0  # libvirt's test driver boots nothing
        missing = [p for p in (self.kernel, self.initrd) if not Path(p).is_file()]
        if self._stale or missing:
            raise SandboxError(f"{self._stale or f'the VM image file {missing[0]} is missing'}; build it with "
                               f"`python -m agents.sandbox.kvm_image --out var/kvm` (.ci/kvm.sh does)")
        image = self._image(spec.image, cancel)
        env = dict(kv.split("=", 1) for kv in image.env if "=" in kv)  # the image's, under the job's
        env.setdefault("PATH", DEFAULT_PATH)
        job = job_env(spec, visible_devices=[str(i) for i in range(len(spec.gpu_uuids))])
        job.setdefault("HOME", "/work")
        if any(sh[3] == "outputs" for sh in shares):
            job["GPUPORTAL_OUTPUTS_DIR"] = "/outputs"
        if checkpoint_dir:
            job["GPUPORTAL_CHECKPOINT_DIR"] = checkpoint_dir
        env.update(job)
        path, kernel = self.state_dir / f"{name}.initrd", self.state_dir / f"{name}.kernel"
        # 0600, created anew (never through a link): it holds the job's environment; libvirt gives it to the
        # VM's QEMU uid for the start.
        try:
            with create_private(kernel) as f, open(self.kernel, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
            with create_private(path) as f:
                # The kernel unpacks the archives in this order, a later entry replacing an earlier one: the
                # image (all under /image) cannot touch /init, and job.sh comes last. All gzip: an uncompressed
                # cpio after a compressed one would have to start 4-byte aligned.
                for part in (self.initrd, image.cpio):
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, f, 1 << 20)
                overlay = kvm_image.job_overlay(image.entrypoint + list(spec.command), env, memory_mb=spec.memory_mb,
                                                pids_limit=spec.pids_limit, terminal=_has_terminal(spec),
                                                mounts=[(tag, point, ro) for _, tag, ro, point, *_ in shares],
                                                uid=JOB_UID if owner is None else owner)
                f.write(gzip.compress(overlay, mtime=0))
                size = f.tell()
        except (OSError, kvm_image.ImageError) as exc:  # a full disk, the cached image pruned under us
            _unlink(path)  # a partial file still holds the job's environment
            _unlink(kernel)
            raise SandboxError(f"could not prepare the VM's initrd on node {self.node}: {exc}") from None
        return str(kernel), str(path), math.ceil((image.size + size) / MiB)

    def _image(self, ref: str, cancel: threading.Event | None = None) -> JobImage:
        """``ref`` from the node's Docker engine, its root filesystem as a cpio (built on first use)."""
        try:
            if self._docker is None:
                self._docker = docker.from_env()
            img = self._docker.images.get(ref)
        except docker.errors.ImageNotFound:
            raise SandboxError(f"image {ref!r} is not present on node {self.node}") from None
        except docker.errors.APIError as exc:
            raise SandboxError(f"image {ref!r}: {exc.explanation or exc}") from None
        except (docker.errors.DockerException, requests.RequestException) as exc:
            raise SandboxError(f"the kvm sandbox reads job images from node {self.node}'s Docker engine, "
                               f"which is not answering: {exc}") from None
        size = int(img.attrs.get("Size") or 0)
        if size > self.max_image_mb * MiB:
            raise SandboxError(f"image {ref!r} is {size / MiB:.0f} MiB, over the kvm sandbox's limit of "
                               f"{self.max_image_mb} MiB on node {self.node} (a VM holds its image in memory)")
        cpio = self.image_cache / f"{img.id.split(':')[-1]}.cpio.gz"
        if cpio.is_file():
            os.utime(cpio)  # its mtime is its last use, for the eviction in prune_image_cache
        else:
            self._export(img, ref, cpio, cancel)
            self.prune_image_cache(keep=cpio)
        cfg = img.attrs.get("Config") or {}
        return JobImage(cpio=cpio, size=size, env=cfg.get("Env") or [], entrypoint=cfg.get("Entrypoint") or [])

    def prune_image_cache(self, keep: Path | None = None, stale_s: float = 3600.0) -> list[str]:
        """Keep the image cache from growing without bound; returns what went.

        Goes: converted images whose image the engine no longer has, then the
        least recently used beyond ``image_cache_mb``; temporary files of an
        export older than ``stale_s``; and, at start (no ``keep``), this node's
        export containers (never started) that a crashed agent left behind.
        ``keep`` (just built) stays.
        """
        gone = []
        try:
            if self._docker is None:
                self._docker = docker.from_env()
            present = {i.id.split(":")[-1] for i in self._docker.images.list(all=True)}
            if keep is None:  # at start only: after a conversion, another launch's export may be in flight
                for c in self._docker.containers.list(all=True,
                                                      filters={"label": f"gpuportal.kvm_export={self.node}"}):
                    if c.status == "created":
                        c.remove(force=True, v=True)
                        gone.append(f"container {c.short_id}")
        except (docker.errors.DockerException, requests.RequestException) as exc:
            log.warning("kvm sandbox: image cache not pruned, the Docker engine is not answering: %s", exc)
            return gone
        if not self.image_cache.is_dir():
            return gone
        now = time.time()
        cached = []
        for p in self.image_cache.iterdir():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # another launch renamed or removed it meanwhile
            if p.name.startswith("."):
                if now - st.st_mtime > stale_s:
                    _unlink(p)
                    gone.append(p.name)
            elif p.name.endswith(".cpio.gz") and p != keep:
                if p.name[: -len(".cpio.gz")] not in present:
                    _unlink(p)
                    gone.append(p.name)
                else:
                    cached.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in cached) + (keep.stat().st_size if keep and keep.is_file() else 0)
        for _, size, p in sorted(cached):  # oldest use first
            if total <= self.image_cache_mb * MiB:
                break
            _unlink(p)
            gone.append(p.name)
            total -= size
        if gone:
            log.info("kvm sandbox: pruned the image cache: %s", ", ".join(gone))
        return gone

    def _export(self, img, ref: str, dest: Path, cancel: threading.Event | None = None) -> None:
        """``docker create`` (never started) + ``export`` + remove, written to ``dest`` as a gzip'd cpio.

        The tar is spooled to disk first (``image_cpio`` reads it twice, for
        hard links). Temporary files and a rename: a concurrent launch of the
        same image builds its own copy, and either rename leaves a whole file.
        Bounded in entries and time (``GPUPORTAL_KVM_MAX_IMAGE_ENTRIES``,
        ``GPUPORTAL_KVM_CONVERT_TIMEOUT_S``), and ``cancel`` ends it.
        """
        t0 = time.monotonic()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = None
        try:
            c = self._docker.containers.create(img.id, command=["/gpuportal-export"], network_disabled=True,
                                               labels={"gpuportal.kvm_export": self.node})
            try:
                with tempfile.TemporaryFile(dir=dest.parent) as tar:
                    for chunk in c.export():
                        if cancel is not None and cancel.is_set():
                            raise kvm_image.ImageError("its conversion was cancelled: the job was stopped")
                        tar.write(chunk)
                    tar.seek(0)
                    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
                    # Level 3: built once per image, but the first launch waits for it.
                    with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=3,
                                                                   mtime=0) as gz:
                        n = kvm_image.image_cpio(
                            tar, gz, max_bytes=self.max_image_mb * MiB, max_entries=self.max_image_entries,
                            time_limit_s=max(0.0, self.convert_timeout_s - (time.monotonic() - t0)), cancel=cancel)
                os.replace(tmp, dest)
                tmp = None
            finally:
                c.remove(force=True, v=True)  # v: the anonymous volumes of the image's VOLUMEs
        except (docker.errors.DockerException, requests.RequestException) as exc:
            raise SandboxError(f"could not export image {ref!r} from node {self.node}'s Docker engine: "
                               f"{exc}") from None
        except (kvm_image.ImageError, tarfile.TarError, OSError) as exc:  # over the limit, a bad tar, disk full
            raise SandboxError(f"image {ref!r} cannot run in the kvm sandbox on node {self.node}: {exc}") from None
        finally:
            if tmp:
                _unlink(tmp)
        log.info("kvm sandbox: image %s (%s) converted for the guest in %.1f s: %d files, %d hard links, "
                 "%.0f MiB, %d entries skipped", ref, img.id[:19], time.monotonic() - t0, n["files"], n["links"],
                 n["bytes"] / MiB, n["skipped"])

    def _dom(self, ref: str):
        try:
            return self.conn.lookupByName(ref)
        except self._libvirt.libvirtError:
            return None  # transient domains vanish once stopped

    def _active(self, ref: str) -> bool:
        dom = self._dom(ref)
        try:
            return dom is not None and bool(dom.isActive())
        except self._libvirt.libvirtError:
            return False

    def _console(self, handle: SandboxHandle) -> bytes:
        return read_console(self.state_dir / f"{handle.ref}.log")

    def poll(self, handle: SandboxHandle) -> tuple[str, int | None]:
        """The exit code from the second serial port (never the console, which the job writes too);
        ``oom`` when the kernel killed any of the job's processes for memory, as docker reports it."""
        if self._active(handle.ref):
            return RUNNING, None
        if was_fenced(self.lease_path, handle.ref):
            return FENCED, None  # its supervisor stopped it when the node's lease ran out
        path = self.state_dir / f"{handle.ref}.exit"
        m = _exit_record(path)
        if m is None and EXIT_RE.search(self._console(handle)):
            # Init got to the end: virtlogd may still be writing the record's bytes QEMU passed it.
            deadline = time.monotonic() + 2.0
            while m is None and time.monotonic() < deadline:
                time.sleep(0.05)
                m = _exit_record(path)
        if not m:
            return EXITED, None  # killed (stop, a crash): no code
        rc, oom_kills = int(m.group(1)), int(m.group(2))
        return (OOM if oom_kills else EXITED), rc

    def read_logs(self, handle: SandboxHandle, offset: int) -> bytes:
        """The job's output from ``offset``: only what the guest printed between its markers.

        While the VM runs, a trailing partial line and anything from an exit
        marker on are held back (it may be the real marker, or a job's line
        that merely starts like one): what was returned never changes later.
        """
        final = not self._active(handle.ref)  # first: a gone VM's console is complete
        return _job_output(self._console(handle), final)[offset:]

    def stop(self, handle: SandboxHandle, grace_s: float) -> None:
        """ACPI power button (the guest's acpid sends SIGTERM to the job), then destroy after ``grace_s``."""
        dom = self._dom(handle.ref)
        if dom is None or not self._active(handle.ref):
            return
        if grace_s > 0:
            deadline = time.monotonic() + grace_s
            press = 0.0
            while time.monotonic() < deadline:
                if not self._active(handle.ref):
                    return
                if time.monotonic() >= press:
                    # Pressed again each second: a press before the guest watches the button is lost.
                    try:
                        dom.shutdownFlags(self._libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
                    except self._libvirt.libvirtError as exc:
                        log.debug("VM %s: power button: %s", handle.ref, exc)
                    press = time.monotonic() + 1.0
                time.sleep(0.1)
            log.info("job %s attempt %s: VM still running %.1fs after the power button, destroying",
                     handle.job_id, handle.attempt, grace_s)
        try:
            dom.destroy()
        except self._libvirt.libvirtError:
            pass  # already gone

    def list_own(self) -> list[tuple[str, int, SandboxHandle]]:
        """Our live VMs (by their metadata), and the attempts whose VM ended while no agent watched:
        their record, console and exit files are still here, so ``poll`` gives their real exit code."""
        out = self._list_live()
        live = {h.ref for _, _, h in out}
        for name, rec in self._records():
            if name in live or not self._ran(name):
                continue  # a launch that never got its VM started ends with its launch, not here
            out.append((rec["job_id"], rec["attempt"], SandboxHandle(
                driver=self.name, ref=name, job_id=rec["job_id"], attempt=rec["attempt"],
                started_at=rec["started_at"], time_limit_s=rec.get("time_limit_s"),
                gpu_indexes=rec.get("gpu_indexes", []))))
        return out

    def _list_live(self) -> list[tuple[str, int, SandboxHandle]]:
        out = []
        for dom in self.conn.listAllDomains():
            if not dom.name().startswith("gpuportal-"):
                continue
            try:
                md = ET.fromstring(dom.metadata(self._libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS))
            except (self._libvirt.libvirtError, ET.ParseError):
                continue  # not ours
            if md.get("node") != self.node or md.get("installation", "") != self.installation:
                continue  # another agent's, on the same libvirtd
            try:
                job_id, attempt = md.get("job"), int(md.get("attempt"))
                out.append((job_id, attempt, SandboxHandle(
                    driver=self.name, ref=dom.name(), job_id=job_id, attempt=attempt,
                    started_at=float(md.get("started_at") or time.time()),
                    time_limit_s=float(md.get("time_limit_s") or 0) or None,
                    gpu_indexes=[int(i) for i in (md.get("gpus") or "").split(",") if i])))
            except (TypeError, ValueError):
                log.warning("VM %s has our node in its metadata but bad job fields", dom.name())
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
        sup = self._supervisors.pop(handle.ref, None)
        if sup is not None:  # its VM is gone: it has nothing left to guard
            sup.kill()
            sup.wait()
        self._remove_files(handle.ref)
        # Uploaded (or given up) by now: the agent removes a sandbox after its end report.
        shutil.rmtree(self._outputs_root(handle.ref), ignore_errors=True)
        forget_fenced(self.lease_path, handle.ref)

    def _remove_files(self, name: str) -> None:
        self._remove_console(name)
        for suffix in (".initrd", ".kernel", ".json"):
            _unlink(self.state_dir / f"{name}{suffix}")

    # -- the durable record of each attempt (what a restarted agent adopts once its VM is gone) ---------

    def _record_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.json"

    def _write_record(self, spec: LaunchSpec, name: str, started: float) -> None:
        with create_private(self._record_path(name)) as f:
            f.write(json.dumps({"job_id": spec.job_id, "attempt": spec.attempt, "started_at": started,
                                "time_limit_s": spec.time_limit_s, "gpu_indexes": list(spec.gpu_indexes),
                                "node": self.node, "installation": self.installation,
                                # 0600: a terminal session's key, for a restarted agent (session_specs)
                                "sessions": [x for x in spec.sessions or [] if x.get("kind") == "terminal"]}).encode())
            f.flush()
            os.fsync(f.fileno())

    def _records(self) -> list[tuple[str, dict]]:
        """(VM name, record) of every attempt this driver launched and has not removed yet."""
        out = []
        for p in sorted(self.state_dir.glob("gpuportal-*.json")):
            try:
                rec = json.loads(p.read_bytes())
                rec["attempt"] = int(rec["attempt"])
                rec["job_id"], rec["started_at"] = str(rec["job_id"]), float(rec["started_at"])
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("kvm sandbox: unreadable record %s left alone", p)
                continue
            if rec.get("node") == self.node and rec.get("installation", "") == self.installation:
                out.append((p.name[: -len(".json")], rec))
        return out

    def _ran(self, name: str) -> bool:
        """Whether the VM of this name ever started: libvirt made its console (or init wrote its exit)."""
        return any(f.exists() for f in console_files(self.state_dir / f"{name}.log")) or \
            (self.state_dir / f"{name}.exit").exists()

    def prune_records(self) -> list[str]:
        """At start: records of launches whose VM never started (the agent died in between) go."""
        live = {h.ref for _, _, h in self._list_live()}
        gone = [name for name, _ in self._records() if name not in live and not self._ran(name)]
        for name in gone:
            self._remove_files(name)
        return gone

    def _remove_console(self, name: str) -> None:
        for f in [*console_files(self.state_dir / f"{name}.log"), self.state_dir / f"{name}.exit"]:
            _unlink(f)
        shutil.rmtree(self._terminal_path(name).parent, ignore_errors=True)

    # -- interactive sessions (agents/sessions.py): a terminal only --------------------

    def _terminal_path(self, name: str) -> Path:
        """The VM's third serial port: a unix socket libvirt makes, in a folder only the agent controls.
        Not in the state folder: a socket's path has at most 107 bytes. Found again by the VM's name
        (a restarted agent), and checked like the state folder (private_dir) before each use."""
        digest = hashlib.sha256(f"{self.state_dir}/{name}".encode()).hexdigest()[:20]
        return Path(tempfile.gettempdir()) / f"gpt-{digest}" / "t.sock"

    def _terminal_socket(self, name: str) -> str:
        path = self._terminal_path(name)
        private_dir(path.parent, 0o700)
        return str(path)

    def session_specs(self, handle: SandboxHandle) -> list[dict]:
        """A live VM's terminal session, from its record: a restarted agent serves it again."""
        try:
            rec = json.loads(self._record_path(handle.ref).read_bytes())
        except (OSError, ValueError):
            return []
        return (rec.get("sessions") or []) if self._active(handle.ref) else []

    def session_targets(self, handle: SandboxHandle, sessions: list[dict]) -> dict[str, tuple]:
        return {}  # no app to reach: the portal refuses jupyter and http sessions for kvm at submit

    def session_shell(self, handle: SandboxHandle) -> "KvmShell":
        return KvmShell(self._terminal_socket(handle.ref))


def _has_terminal(spec: LaunchSpec) -> bool:
    return any(s.get("kind") == "terminal" for s in spec.sessions or [])


class KvmShell:
    """The job's terminal in the VM: a shell the guest serves on its third serial port (its image's
    ``sh -i``, as the job's user), reached through the port's unix socket on the host. One shell for
    the VM, served again when it exits; a serial line has no window size."""

    def __init__(self, path: str):
        self.path = path

    def spawn(self) -> "KvmTerminal":
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            sock.sendall(b"\n")  # the prompt again: what the shell printed before went to nobody
        except OSError:
            sock.close()
            raise
        return KvmTerminal(sock)


class KvmTerminal:
    def __init__(self, sock):
        self.sock, self.fd = sock, sock.fileno()

    def resize(self, cols: int, rows: int) -> None:
        pass

    def close(self) -> None:
        self.sock.close()


def _job_output(raw: bytes, final: bool) -> bytes:
    """The job's output in a console log: between the start marker and the exit marker.

    ``final`` (the VM is gone): up to the last exit marker, the guest's own.
    Before that, up to the first exit marker or the last complete line,
    whichever comes first, so what was returned once never changes.
    """
    i = raw.find(START_MARKER + b"\n")
    if i < 0:
        return b""
    body = raw[i + len(START_MARKER) + 1:]
    ends = [m.start() for m in EXIT_RE.finditer(body)]
    if final:
        return body[:ends[-1]] if ends else body
    cut = body.rfind(b"\n") + 1
    return body[:min([cut] + ends)]


def _exit_record(path: Path):
    try:
        return EXIT_RECORD_RE.search(path.read_bytes())
    except FileNotFoundError:
        return None


def _env_mb(name: str, default: int, unit: str = "MiB") -> int:
    raw = os.environ.get(name) or str(default)
    if not raw.isdigit() or int(raw) < 1:
        raise SandboxError(f"{name}: expected a positive number of {unit}, got {raw!r}")
    return int(raw)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
