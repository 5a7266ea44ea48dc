"""A job VM's serial console as one stream, across virtlogd's rotation.

libvirt hands the console file to virtlogd, which rotates it at its
``max_size`` (2 MiB by default, ``/etc/libvirt/virtlogd.conf``): the file
moves to ``<path>.0``, older ones shift to ``.1``, ``.2``, and the oldest
beyond ``max_backups`` (3) is deleted. Reading only ``<path>`` loses the job's
first bytes at the first rotation (its start marker with them).

Each read first appends the rotated files it has not archived yet to
``<path>.archive``, oldest first (a rotated file never changes again; each is
recorded by inode, size and mtime in ``<path>.archived``), so the stream is
the archive plus the live file and an offset into it never moves. The agent
reads a running job's console every second, so nothing is lost unless a job
prints more than ``max_size`` × ``max_backups`` between two reads (or while
the agent is down): for such jobs raise ``max_size`` in virtlogd.conf.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_console(path: Path) -> bytes:
    """Everything the VM wrote to the console at ``path`` so far (b"" before it exists)."""
    data = b""
    for _ in range(10):
        before = _inode(path)
        archive = _archive_rotated(path)
        try:
            live = path.read_bytes()
        except FileNotFoundError:
            live = b""
        data = archive + live
        if _inode(path) == before:  # no rotation while we read: archive and live file join up
            break
    return data


def console_files(path: Path) -> list[Path]:
    """The live file, its rotations and the archive: what ``remove`` deletes."""
    return [path, *_rotated(path), Path(f"{path}.archive"), Path(f"{path}.archived")]


def _archive_rotated(path: Path) -> bytes:
    archive, record = Path(f"{path}.archive"), Path(f"{path}.archived")
    try:
        done = set(json.loads(record.read_text()))
    except (OSError, ValueError):
        done = set()
    added = False
    for p in reversed(_rotated(path)):  # oldest (highest number) first
        try:
            st = os.stat(p)
            key = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
            if key in done:
                continue
            data = p.read_bytes()
        except FileNotFoundError:
            continue  # deleted by a rotation meanwhile
        with open(archive, "ab") as f:
            f.write(data)
        done.add(key)
        added = True
    if added:
        record.write_text(json.dumps(sorted(done)))
    try:
        return archive.read_bytes()
    except FileNotFoundError:
        return b""


def _rotated(path: Path) -> list[Path]:
    """``<path>.0``, ``<path>.1``, ... that exist, newest first."""
    found = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1:]
        if suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None
