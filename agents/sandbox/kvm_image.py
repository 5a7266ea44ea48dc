"""The KVM sandbox's boot image: a Debian kernel plus a busybox initramfs, built
locally with no registry and no network beyond ``apt-get download`` (Debian's
own client, for the kernel package when none is cached).

    python -m agents.sandbox.kvm_image --out var/kvm [--force] [--kernel-deb PATH]

Writes into ``--out``:

- ``vmlinux``: the kernel's uncompressed ELF, cut out of the Debian bzImage.
  QEMU boots it through PVH, which skips the decompressor (about 3 s under TCG,
  docs/sandboxes.md section 2). ``vmlinuz`` is kept as well, and used
  when the ELF cannot be cut out;
- ``initramfs.cpio.gz``: busybox-static, the two modules ACPI power-button
  handling needs (``button``, ``evdev``), virtio-net's modules (loaded only
  when the domain has a NIC: a job whose project allows network; the address
  comes by DHCP, ``DHCP_SCRIPT``), and ``/init`` (``INIT`` below);
- ``manifest.json``: what was built from what. A second run with the same
  inputs does nothing (the cache).

Per job, the driver appends two archives to a copy of the initramfs: the job's
image (``image_cpio``: the root filesystem of the Docker image, every path under
``/image``, converted once per image id) and ``job_overlay`` (``/gpuportal/job.sh``:
the command and environment). The kernel unpacks concatenated archives into one
rootfs, so the job needs no disk, no virtio module and no length limit of the
kernel command line. ``/init`` mounts /proc, /sys, /dev, /tmp and /work inside
``/image`` and runs the command chrooted there as uid/gid 65534 (``job_overlay``
says how; the image needs no shell).

The guest protocol. On the serial console (ttyS0): ``GPUPORTAL-JOB-START`` on a
line of its own, then the job's stdout and stderr byte for byte (output
post-processing is off), then ``GPUPORTAL-JOB-EXIT rc=N`` and an ACPI power-off.
The job writes that console too, so the markers there only delimit its output:
the exit code the agent believes comes from the second serial port (ttyS1),
which only init opens (root's, mode 0600; the job runs as 65534 without
capabilities), as ``GPUPORTAL-JOB-EXIT rc=N oom_kill=K`` once the job has ended.
The job runs in a cgroup of its own (``memory.max`` = its memory, so the image
and initrd that init holds in RAM never count as the job's; ``pids.max``), and
``oom_kill`` is that cgroup's count of processes the kernel killed for memory.
The ACPI power button (libvirt ``shutdown``) sends SIGTERM to the job
(``power_button`` in INIT, a read of the button's evdev device), which then ends
the same way.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = Path(os.environ.get("GPUPORTAL_KVM_IMAGE_DIR") or REPO / "var" / "kvm")
BUSYBOX = "/bin/busybox"
START_MARKER = b"GPUPORTAL-JOB-START"
EXIT_MARKER = b"GPUPORTAL-JOB-EXIT rc="
# Modules (relative to lib/modules/<version>/kernel) the guest loads, in this order: the power button's,
# and virtio-net's for a job that may use the network (the domain then has a virtio NIC).
POWER_MODULES = ("drivers/acpi/button.ko", "drivers/input/evdev.ko")
NET_MODULES = ("drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko", "drivers/virtio/virtio_pci_legacy_dev.ko",
               "drivers/virtio/virtio_pci_modern_dev.ko", "drivers/virtio/virtio_pci.ko", "net/core/failover.ko",
               "drivers/net/net_failover.ko", "drivers/net/virtio_net.ko")
# virtio-9p's, for a job given host folders (its datasets read-only at /datasets/<name>, its /outputs):
# the domain then has a <filesystem> per folder (kvm_domain.domain_xml).
FS_MODULES = ("fs/netfs/netfs.ko", "fs/fscache/fscache.ko", "net/9p/9pnet.ko", "net/9p/9pnet_virtio.ko", "fs/9p/9p.ko")
MODULES = POWER_MODULES + NET_MODULES + FS_MODULES
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MOUNT_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,200}\Z")
# Where the job's image lies in the guest, and who runs the job there (nobody:nogroup, as in the docker
# sandbox); INIT spells both out too.
IMAGE_ROOT = "image"
JOB_UID = 65534

INIT = r"""#!/bin/sh
# gpuportal KVM sandbox init (agents/sandbox/kvm_image.py). Runs /gpuportal/job.sh once; it chroots into /image.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# The job's view: the image with its own /proc, read-only /sys, /dev, and tmpfs /tmp and /work. A mount point
# the image made a symlink or a file is replaced first: mount follows a symlink, out of /image.
for d in proc sys dev tmp work; do
  { [ -L /image/$d ] || { [ -e /image/$d ] && [ ! -d /image/$d ]; }; } && rm -f /image/$d
  mkdir -p /image/$d
done
mount -t proc proc /image/proc
mount -t sysfs -o ro sysfs /image/sys
mount -t devtmpfs devtmpfs /image/dev
mkdir -p /image/dev/pts /image/dev/shm
mount -t devpts devpts /image/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /image/dev/shm
mount -t tmpfs -o mode=1777 tmpfs /image/tmp
mount -t tmpfs -o mode=0700,uid=65534,gid=65534 tmpfs /image/work
# The exit code's own channel: the job must not be able to open it.
chown 0:0 /dev/ttyS1 && chmod 0600 /dev/ttyS1
# Host folders over virtio-9p (job.sh's neighbour mounts.sh: "TAG MOUNT_POINT ro|rw" per line, mount points
# below /image that the driver names: datasets/<name>, outputs). Before the job, as root: a mount point the
# image made a symlink or a file is replaced first, as above, and a folder on the way too.
if [ -s /gpuportal/mounts.sh ]; then
  for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci netfs fscache 9pnet \
           9pnet_virtio 9p; do insmod /lib/modules/$m.ko 2>/dev/null; done
  while read -r tag point mode; do
    p=/image
    for part in $(echo "$point" | tr / ' '); do
      p=$p/$part
      { [ -L $p ] || { [ -e $p ] && [ ! -d $p ]; }; } && rm -f $p
      mkdir -p $p
    done
    i=0
    until mount -t 9p -o trans=virtio,version=9p2000.L,cache=none,msize=262144,$mode "$tag" "$p" 2>/dev/null; do
      i=$((i + 1)); [ $i -ge 50 ] && { echo "gpuportal: could not mount $point" > /dev/ttyS0; break; }; sleep 0.1
    done
  done < /gpuportal/mounts.sh
fi
# The job's limits (job.sh's neighbour limits.sh: MEMORY_MAX, PIDS_MAX) in a cgroup of its own.
. /gpuportal/limits.sh
mkdir -p /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo "+memory +pids" > /sys/fs/cgroup/cgroup.subtree_control
mkdir /sys/fs/cgroup/job
echo "$MEMORY_MAX" > /sys/fs/cgroup/job/memory.max
echo 0 > /sys/fs/cgroup/job/memory.swap.max 2>/dev/null
echo "$PIDS_MAX" > /sys/fs/cgroup/job/pids.max
# Keep kernel messages out of the job's output, and pass its bytes through untouched.
echo 1 > /proc/sys/kernel/printk
exec </dev/null >/dev/ttyS0 2>/dev/null  # the shell's own "Terminated" is not the job's output
stty -F /dev/ttyS0 -opost 2>/dev/null
for m in /lib/modules/evdev.ko /lib/modules/button.ko; do [ -f "$m" ] && insmod "$m" 2>/dev/null; done
hostname sandbox
ip link set lo up
# A NIC exists only when the job may use the network: a virtio-net device (vendor 0x1af4, device 0x1000 or
# 0x1041). Then its driver, and an address by DHCP from the domain's network (QEMU's own for "user").
for d in /sys/bus/pci/devices/*; do
  case "$(cat $d/vendor 2>/dev/null):$(cat $d/device 2>/dev/null)" in
    0x1af4:0x1000|0x1af4:0x1041)
      for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci failover net_failover \
               virtio_net; do insmod /lib/modules/$m.ko 2>/dev/null; done
      i=0; while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 50 ]; do i=$((i + 1)); sleep 0.1; done
      ip link set eth0 up && udhcpc -i eth0 -n -q -t 10 -T 1 -s /gpuportal/dhcp.sh >/dev/null 2>&1
      break ;;
  esac
done
power_button() {  # the ACPI power button (libvirt shutdown) sends SIGTERM to the job
  i=0
  while [ $i -lt 300 ]; do  # the button's input device appears a moment after insmod
    for ev in /sys/class/input/event*; do
      if [ "$(cat "$ev/device/name" 2>/dev/null)" = "Power Button" ]; then
        dd if="/dev/input/${ev##*/}" of=/dev/null bs=64 count=1 2>/dev/null && kill -TERM "$1"
        return
      fi
    done
    i=$((i + 1)); sleep 0.1
  done
}
echo "GPUPORTAL-JOB-START"
sh -c 'echo $$ > /sys/fs/cgroup/job/cgroup.procs && exec sh /gpuportal/job.sh' 2>&1 &
job=$!
power_button "$job" &
wait "$job"
rc=$?
# What the job left running goes now: nothing of it writes the console after the end marker.
echo 1 > /sys/fs/cgroup/job/cgroup.kill
oom=$(sed -n 's/^oom_kill //p' /sys/fs/cgroup/job/memory.events)
echo "GPUPORTAL-JOB-EXIT rc=$rc"
echo "GPUPORTAL-JOB-EXIT rc=$rc oom_kill=${oom:-0}" > /dev/ttyS1
sync
poweroff -f
sleep 5
echo o > /proc/sysrq-trigger
"""

# udhcpc's hook: set the address, the default route and the image's resolv.conf.
DHCP_SCRIPT = r"""#!/bin/sh
case "$1" in
  deconfig) ip -4 addr flush dev "$interface" ;;
  bound|renew)
    ip -4 addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
    for r in $router; do ip route replace default via "$r" dev "$interface"; break; done
    mkdir -p /image/etc && rm -f /image/etc/resolv.conf
    for d in $dns; do echo "nameserver $d"; done > /image/etc/resolv.conf ;;
esac
"""

# Bump when INIT or the layout changes: invalidates every cache.
BUILD_VERSION = 6


@dataclass
class Image:
    kernel: str
    initrd: str
    kernel_version: str


class ImageError(Exception):
    pass


# -- cpio (newc) --------------------------------------------------------------

class Cpio:
    """A newc archive writer: what the kernel's initramfs unpacker reads.

    Writes to ``out`` (a binary file object), or to memory when there is none:
    then ``finish`` returns the archive.
    """

    def __init__(self, out=None):
        self.out = io.BytesIO() if out is None else out
        self.pos = 0  # ``out`` may be a GzipFile, whose tell() counts compressed bytes
        self.ino = 1
        self.dirs: set[str] = set()

    def _write(self, b: bytes):
        self.out.write(b)
        self.pos += len(b)

    def _entry(self, name: str, mode: int, data=b"", rdev: tuple[int, int] = (0, 0), *, size: int | None = None,
               uid: int = 0, gid: int = 0, mtime: int = 0, ino: int | None = None, nlink: int | None = None) -> int:
        """One entry; ``data`` is bytes or a file object holding ``size`` bytes. Returns its inode number."""
        name = name.lstrip("/").encode("utf-8", "surrogateescape")  # tarfile's decoding of odd bytes, undone
        size = len(data) if size is None else size
        # Every header field is 8 hex digits that the kernel reads at fixed offsets: a wider value would
        # shift the rest of the archive, and the data after it would be read as headers (entries of the
        # image's choosing outside /image). A far-future mtime is clamped; anything else is refused.
        mtime = min(max(0, mtime), 0xFFFFFFFF)
        for field_name, v in (("size", size), ("uid", uid), ("gid", gid), ("inode", ino or 0), ("mode", mode)):
            if not 0 <= v <= 0xFFFFFFFF:
                raise ImageError(f"{name.decode(errors='replace')}: {field_name} {v} does not fit a cpio header")
        if ino is None:
            ino, self.ino = self.ino, self.ino + 1
        nlink = nlink or (2 if stat.S_ISDIR(mode) else 1)
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, uid, gid, nlink, mtime, size, 0, 0, rdev[0], rdev[1], len(name) + 1, 0))
        self._write(hdr.encode() + name + b"\0")
        self._write(b"\0" * (-self.pos % 4))
        if isinstance(data, bytes):
            self._write(data)
        else:
            left = size
            while left:
                chunk = data.read(min(left, 1 << 20))
                if not chunk:
                    raise ImageError(f"{name.decode(errors='replace')}: the data ended {left} bytes short")
                self._write(chunk)
                left -= len(chunk)
        self._write(b"\0" * (-self.pos % 4))
        return ino

    def dir(self, name: str, perm: int = 0o755, **meta):
        """A directory and its missing parents. With ``meta`` (uid, gid, mtime) it is written even when
        an earlier entry already implied it: the unpacker then sets its owner and mode."""
        name = name.strip("/")
        if not name or (name in self.dirs and not meta):
            return
        self.dir(os.path.dirname(name))
        self.dirs.add(name)
        self._entry(name, stat.S_IFDIR | perm, **meta)

    def file(self, name: str, data, perm: int = 0o644, **meta) -> int:
        self.dir(os.path.dirname(name.strip("/")))
        return self._entry(name, stat.S_IFREG | perm, data, **meta)

    def symlink(self, name: str, target: str, **meta):
        self.dir(os.path.dirname(name.strip("/")))
        self._entry(name, stat.S_IFLNK | 0o777, target.encode(), **meta)

    def chardev(self, name: str, major: int, minor: int, perm: int = 0o600):
        self.dir(os.path.dirname(name.strip("/")))
        self._entry(name, stat.S_IFCHR | perm, rdev=(major, minor))

    def finish(self) -> bytes | None:
        self._entry("TRAILER!!!", 0)
        self._write(b"\0" * (-self.pos % 512))
        return self.out.getvalue() if isinstance(self.out, io.BytesIO) else None


# The terminal session's serial line (docs/sessions.md): the guest's third port, which the job cannot open.
TERMINAL_TTY = "/dev/ttyS2"


def job_overlay(command: list[str], env: dict[str, str], *, memory_mb: int = 1024, pids_limit: int = 512,
                terminal: bool = False, mounts: list[tuple[str, str, bool]] = (), uid: int = JOB_UID) -> bytes:
    """The per-job cpio: ``/gpuportal/job.sh`` runs the command in the job's image,
    ``/gpuportal/limits.sh`` holds the job cgroup's limits for INIT, and ``/gpuportal/mounts.sh`` the
    host folders INIT mounts over virtio-9p before the job: ``(tag, mount point below /image,
    read_only)``, tags and mount points of ``[A-Za-z0-9_./-]`` only (the driver makes them).

    The guest's own busybox makes the switch, so the image needs no shell:
    ``env -i`` leaves exactly ``env``; ``setpriv --nnp`` makes setuid bits
    in the image inert (Docker's no-new-privileges); ``nsenter`` chroots into
    ``/image``, enters ``/work``, drops to uid/gid 65534 without supplementary
    groups and execs ``command`` (``$PATH`` searched inside the image), keeping
    the process id that the power button's SIGTERM goes to.

    ``terminal``: job.sh first starts, in the background and in the job's cgroup, a loop that serves a
    shell (``sh -i`` of the image, the same user, environment and chroot) on the third serial port,
    its controlling terminal, again whenever it exits; it ends with the job.

    ``uid``: the job's uid and gid instead of 65534 (its project's, when it mounts the project's
    volumes: the guest then checks their modes against the owner it is shown, and QEMU gives what
    it writes that owner); job.sh first gives the job's ``/work`` to it.
    """
    pairs = []
    for k, v in env.items():
        if not _ENV_NAME.match(k):
            log.warning("dropping env name %r: not a shell variable name", k)
            continue
        pairs.append(f"{k}={v}")
    def as_job(argv: list[str], extra: tuple = ()) -> list[str]:
        return [BUSYBOX, "env", "-i", *pairs, *extra, BUSYBOX, "setpriv", "--nnp", BUSYBOX, "nsenter",
                f"-r/{IMAGE_ROOT}", f"-w/{IMAGE_ROOT}/work", "-S", str(int(uid)), "-G", str(int(uid)), "--", *argv]

    script = "# written by the gpuportal kvm driver\n"
    if int(uid) != JOB_UID:
        script += f"chown {int(uid)}:{int(uid)} /{IMAGE_ROOT}/work\n"
    if terminal:
        shell = " ".join(shlex.quote(a) for a in [BUSYBOX, "setsid", "-c",
                                                 *as_job(["sh", "-i"], ("TERM=xterm-256color",))])
        script += (f"while [ -e {TERMINAL_TTY} ]; do {shell} <>{TERMINAL_TTY} >&0 2>&0; sleep 1; done "
                   ">/dev/null 2>&1 </dev/null &\n")
    script += "exec " + " ".join(shlex.quote(a) for a in as_job(command)) + "\n"
    c = Cpio()
    c.file("gpuportal/job.sh", script.encode(), 0o755)
    c.file("gpuportal/limits.sh", f"MEMORY_MAX={int(memory_mb) * 2**20}\nPIDS_MAX={int(pids_limit)}\n".encode())
    lines = []
    for tag, point, read_only in mounts:
        if not (_MOUNT_WORD.match(tag) and _MOUNT_WORD.match(point)) or ".." in point.split("/"):
            raise ImageError(f"mount {tag!r} at {point!r}: not a plain tag and relative path")
        lines.append(f"{tag} {point} {'ro' if read_only else 'rw'}\n")
    c.file("gpuportal/mounts.sh", "".join(lines).encode())
    return c.finish()


# -- job images ---------------------------------------------------------------

def _image_path(name: str) -> str | None:
    """A tar member's name relative to the image's root ("" for the root), or None when it would leave it."""
    if name.startswith("/"):
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return None if ".." in parts else "/".join(parts)


class _Links:
    """The symlinks written so far, as a tree of path components. Whether a path goes through one then
    costs a step per component; checking every joined prefix against a set cost the square of the depth
    per entry (minutes for an image of a few thousand nested folders)."""

    def __init__(self):
        self.root: dict = {}  # component -> [is a symlink now, children]

    def add(self, parts: list[str]) -> None:
        node = self.root
        for c in parts[:-1]:
            node = node.setdefault(c, [False, {}])[1]
        node.setdefault(parts[-1], [False, {}])[0] = True

    def discard(self, parts: list[str]) -> None:
        node, entry = self.root, None
        for c in parts:
            entry = node.get(c)
            if entry is None:
                return
            node = entry[1]
        entry[0] = False

    def crosses(self, parents: list[str]) -> bool:
        node = self.root
        for c in parents:
            entry = node.get(c)
            if entry is None:
                return False
            if entry[0]:
                return True
            node = entry[1]
        return False


def image_cpio(tar_file, out, *, prefix: str = IMAGE_ROOT, max_bytes: int | None = None,
               max_entries: int | None = None, time_limit_s: float | None = None, cancel=None) -> dict:
    """Write a container image's filesystem (the tar ``docker export`` streams) to ``out`` as newc cpio, every
    path under ``prefix``; returns counts of what was written and skipped.

    Linear in the tar's size. ImageError when the tar holds more than
    ``max_entries`` entries, when it takes longer than ``time_limit_s``, or
    when ``cancel`` (a threading.Event) is set: a stop of the job ends it.

    Kept, with modes, owners and mtimes (Python checks .pyc files against their
    source's mtime): directories, regular files, symlinks, hard links. Skipped:
    device nodes and fifos (the guest mounts its own /dev), and every entry the
    kernel's unpacker could place outside ``prefix``: absolute and ``..``
    paths, and paths through a symlink made earlier in the archive (the
    unpacker follows it). ``tar_file`` must be seekable: a hard link's target
    must be marked (nlink 2) before the link itself is read. ImageError when
    the files add up to more than ``max_bytes``.
    """
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s

    def check(i: int) -> None:
        if max_entries is not None and i > max_entries:
            raise ImageError(f"it holds more than {max_entries} files and folders, the limit of this node")
        if i % 256 == 0:
            if cancel is not None and cancel.is_set():
                raise ImageError("its conversion was cancelled: the job was stopped")
            if deadline is not None and time.monotonic() > deadline:
                raise ImageError(f"its conversion took longer than {time_limit_s:.0f} s, the limit of this node")

    c = Cpio(out)
    c.dir(prefix)
    n = {"files": 0, "bytes": 0, "links": 0, "skipped": 0}
    with tarfile.open(fileobj=tar_file, mode="r:") as tf:
        members = []
        for m in tf:  # one pass over the headers first, bounded: a hard link's target is marked before it
            members.append(m)
            check(len(members))
        linked = {_image_path(m.linkname) for m in members if m.islnk()}
        symlinks = _Links()  # written so far: nothing may go through one
        inodes: dict[str, int] = {}  # regular file -> its inode, for hard links to it
        for i, m in enumerate(members):
            check(i)
            path = _image_path(m.name)
            parts = path.split("/") if path else []
            if path is None or symlinks.crosses(parts[:-1]):
                log.debug("image: skipping unsafe path %r", m.name)
                n["skipped"] += 1
                continue
            name, meta = f"{prefix}/{path}", {"uid": m.uid, "gid": m.gid, "mtime": max(0, int(m.mtime))}
            if m.isdir():
                if path:
                    c.dir(name, m.mode & 0o7777, **meta)
            elif m.isreg():
                n["files"], n["bytes"] = n["files"] + 1, n["bytes"] + m.size
                if max_bytes is not None and n["bytes"] > max_bytes:
                    raise ImageError(f"its files add up to more than the limit of {max_bytes // 2**20} MiB")
                inodes[path] = c.file(name, tf.extractfile(m), m.mode & 0o7777, size=m.size,
                                      nlink=2 if path in linked else 1, **meta)
            elif m.issym():
                c.symlink(name, m.linkname, **meta)
                symlinks.add(parts)
                continue
            elif m.islnk() and _image_path(m.linkname) in inodes:
                # Same inode, nlink 2, no data: the unpacker links it to the first entry of that inode.
                c.file(name, b"", m.mode & 0o7777, ino=inodes[_image_path(m.linkname)], nlink=2, **meta)
                n["links"] += 1
            else:
                n["skipped"] += 1  # not written: a symlink at this path stays one
                continue
            if parts:
                symlinks.discard(parts)  # written: the unpacker replaced whatever was there
    c.finish()
    return n


# -- kernel -------------------------------------------------------------------

def _kernel_deb(out: Path) -> Path:
    debs = sorted(out.glob("linux-image-*-amd64_*.deb"))
    if debs:
        return debs[-1]
    dep = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True)
    m = re.search(r"Depends: (linux-image-[0-9][^\s]*)", dep.stdout)
    if not m:
        raise ImageError("cannot tell which kernel linux-image-amd64 depends on "
                         f"(apt-cache: {dep.stderr.strip() or dep.stdout.strip()}); run apt-get update")
    log.info("downloading %s with apt-get download", m.group(1))
    r = subprocess.run(["apt-get", "download", "-q", m.group(1)], cwd=out, capture_output=True, text=True)
    debs = sorted(out.glob("linux-image-*-amd64_*.deb"))
    if r.returncode or not debs:
        raise ImageError(f"apt-get download {m.group(1)} failed: {r.stderr.strip()}")
    return debs[-1]


def _extract_from_deb(deb: Path, out: Path) -> tuple[Path, str, dict[str, bytes]]:
    """vmlinuz and the MODULES out of a linux-image .deb, with dpkg-deb and tarfile."""
    p = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    vmlinuz, version, mods = None, None, {}
    with tarfile.open(fileobj=p.stdout, mode="r|") as tf:
        for m in tf:
            name = m.name.lstrip("./")
            if re.fullmatch(r"boot/vmlinuz-.+", name) and m.isfile():
                version = name.split("vmlinuz-", 1)[1]
                vmlinuz = out / "vmlinuz"
                vmlinuz.write_bytes(tf.extractfile(m).read())
            for mod in MODULES:
                if m.isfile() and name.endswith("/kernel/" + mod):
                    mods[os.path.basename(mod)] = tf.extractfile(m).read()
    if p.wait() != 0 or vmlinuz is None:
        raise ImageError(f"{deb} holds no boot/vmlinuz-* (dpkg-deb rc {p.returncode})")
    return vmlinuz, version, mods


def _host_kernel() -> tuple[Path, str, dict[str, bytes]] | None:
    """A Debian kernel already installed in /boot (with its modules), if any."""
    for vmlinuz in sorted(glob.glob("/boot/vmlinuz-*-amd64"), reverse=True):
        version = vmlinuz.split("vmlinuz-", 1)[1]
        mods = {}
        for mod in MODULES:
            p = Path(f"/lib/modules/{version}/kernel/{mod}")
            if p.is_file():
                mods[p.name] = p.read_bytes()
        return Path(vmlinuz), version, mods
    return None


def extract_vmlinux(vmlinuz: bytes) -> bytes | None:
    """The ELF inside an xz-compressed bzImage, or None (then boot the bzImage)."""
    off = vmlinuz.find(b"\xfd7zXZ\x00")
    while off >= 0:
        d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        try:
            elf = d.decompress(vmlinuz[off:])
            if elf[:4] == b"\x7fELF":
                return elf
        except lzma.LZMAError:
            pass
        off = vmlinuz.find(b"\xfd7zXZ\x00", off + 1)
    return None


# -- build --------------------------------------------------------------------

def _initramfs(mods: dict[str, bytes]) -> bytes:
    c = Cpio()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "etc", "root", "lib/modules",
              "gpuportal", IMAGE_ROOT):
        c.dir(d)
    c.chardev("dev/console", 5, 1)
    c.chardev("dev/null", 1, 3, 0o666)
    c.file("bin/busybox", Path(BUSYBOX).read_bytes(), 0o755)
    listing = subprocess.run([BUSYBOX, "--list-full"], capture_output=True, text=True, check=True).stdout
    for path in listing.split():
        if path != "bin/busybox":
            c.symlink(path, "/bin/busybox")
    c.file("init", INIT.encode(), 0o755)
    c.file("gpuportal/dhcp.sh", DHCP_SCRIPT.encode(), 0o755)
    c.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    c.file("etc/group", b"root:x:0:\n")
    for name, data in sorted(mods.items()):
        c.file(f"lib/modules/{name}", data)
    return gzip.compress(c.finish(), compresslevel=6, mtime=0)


def build(out: str | Path = DEFAULT_DIR, *, force: bool = False, kernel_deb: str | None = None) -> Image:
    """Build (or find cached) kernel + initramfs in ``out``; returns their paths."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not Path(BUSYBOX).is_file():
        raise ImageError(f"{BUSYBOX} is missing: apt-get install busybox-static (.ci/kvm.sh does)")
    bb = Path(BUSYBOX).stat()
    manifest = out / "manifest.json"
    key = {"build_version": BUILD_VERSION, "init_sha256": hashlib.sha256((INIT + DHCP_SCRIPT).encode()).hexdigest(),
           "busybox": [bb.st_size, int(bb.st_mtime)]}
    if not force and manifest.is_file():
        try:
            m = json.loads(manifest.read_text())
            if all(m.get(k) == v for k, v in key.items()) and Path(m["kernel"]).is_file() \
                    and Path(m["initrd"]).is_file():
                return Image(m["kernel"], m["initrd"], m["kernel_version"])
        except (ValueError, KeyError):
            pass
    t0 = time.monotonic()
    host = None if kernel_deb else _host_kernel()
    if host:
        vmlinuz_src, version, mods = host
        vmlinuz = out / "vmlinuz"
        shutil.copyfile(vmlinuz_src, vmlinuz)
        source = str(vmlinuz_src)
    else:
        deb = Path(kernel_deb) if kernel_deb else _kernel_deb(out)
        vmlinuz, version, mods = _extract_from_deb(deb, out)
        source = str(deb)
    elf = extract_vmlinux(vmlinuz.read_bytes())
    kernel = vmlinuz
    if elf is not None:
        kernel = out / "vmlinux"
        _atomic_write(kernel, elf)
    else:
        log.warning("could not cut an ELF vmlinux out of %s: booting the bzImage (slower under TCG)", vmlinuz)
    for group, what in ((POWER_MODULES, "the ACPI power button will not reach the job"),
                        (NET_MODULES, "jobs with network will have no NIC"),
                        (FS_MODULES, "jobs naming datasets or writing /outputs cannot mount them")):
        if any(os.path.basename(m) not in mods for m in group):
            log.warning("kernel %s lacks some of %s: %s", version, group, what)
    initrd = out / "initramfs.cpio.gz"
    _atomic_write(initrd, _initramfs(mods))
    for p in (out, kernel, initrd):  # qemu runs as libvirt-qemu: it must be able to read these
        p.chmod(0o755 if p.is_dir() else 0o644)
    m = dict(key, kernel=str(kernel), initrd=str(initrd), kernel_version=version, kernel_source=source,
             modules=sorted(mods), built_s=round(time.monotonic() - t0, 2))
    _atomic_write(manifest, json.dumps(m, indent=1).encode())
    log.info("built the KVM sandbox image in %s (%.1f s): kernel %s", out, m["built_s"], version)
    return Image(str(kernel), str(initrd), version)


def _atomic_write(path: Path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_DIR), help="cache directory (default: var/kvm)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the cache is current")
    ap.add_argument("--kernel-deb", help="a linux-image-*.deb to use instead of /boot or apt-get download")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="kvm_image: %(message)s")
    try:
        img = build(args.out, force=args.force, kernel_deb=args.kernel_deb)
    except (ImageError, OSError, subprocess.CalledProcessError) as exc:
        print(f"kvm_image: ERROR: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"kernel": img.kernel, "initrd": img.initrd, "kernel_version": img.kernel_version}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
