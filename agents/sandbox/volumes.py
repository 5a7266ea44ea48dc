"""Project volumes on disk: the one layout the portal and the agents agree on.

The operator provides one directory tree at the same path on the portal and on every
node (NFS, Lustre, CephFS; a local directory on one machine). A volume is the folder
``<root>/<org>/<project>/<volume>``; a job's checkpoints live under
``<volume>/.checkpoints/<job id>``, or ``<root>/<org>/<project>/.checkpoints/<job id>``
when the job names no writable volume. A project's folders belong to the project's own
uid and gid (the docker sandbox runs the project's jobs under it) with mode 0770, so one
tenant's jobs cannot read another's files even on the same node.

Paths are walked one component at a time with ``O_NOFOLLOW``: a symlink anywhere below
the root (planted by a job) is refused, never followed out of the volume.
"""

from __future__ import annotations

import errno
import os
import re

CHECKPOINTS = ".checkpoints"
MOUNT_ROOT = "/data"  # a volume appears in a container at /data/<volume>
CHECKPOINT_MOUNT = "/checkpoint"  # the project default checkpoint folder, when no volume holds it
# The names used in paths: slugs (no dot, so no "..", no hidden name, nothing to escape with).
SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")
DIR_MODE = 0o770


class VolumePathError(ValueError):
    """A path that would leave the volume, or a folder that cannot be prepared; the message says which."""


def _slugs(*names: str) -> str:
    for name in names:
        if not isinstance(name, str) or not SLUG.match(name):
            raise VolumePathError(f"{name!r} is not a slug")
    return "/".join(names)


def volume_relpath(org: str, project: str, volume: str) -> str:
    return _slugs(org, project, volume)


def checkpoint_relpath(org: str, project: str, job_id: str | int, volume: str | None = None) -> str:
    """Where a job's checkpoints live below the root: the same folder for every attempt, on any node."""
    base = _slugs(org, project, volume) if volume else _slugs(org, project)
    return f"{base}/{CHECKPOINTS}/{int(job_id)}"


def split_relpath(relpath: str) -> list[str]:
    """Components of a relative path, refusing what could name something outside the base."""
    if not isinstance(relpath, str) or "\x00" in relpath:
        raise VolumePathError("the path holds a NUL character")
    if relpath.startswith("/") or "\\" in relpath:
        raise VolumePathError("the path must be relative to the volume")
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise VolumePathError("the path may not contain '..'")
    return parts


def open_dir(root: str | int, parts: list[str], *, create: bool = False, owner: int | None = None,
             owned_from: int = 0) -> int:
    """A file descriptor of ``root``/``parts`` reached without following any symlink.

    ``root`` is a path (the operator's, trusted) or an open folder's descriptor (kept open).

    ``create`` makes missing folders; those at depth ``owned_from`` and deeper are made mode
    0770 and, when ``owner`` is given and we may, owned by uid = gid = owner (the project's
    folders). The caller closes the descriptor.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    if isinstance(root, int):
        fd = os.dup(root)
    else:
        if create:
            os.makedirs(root, exist_ok=True)
        fd = os.open(root, flags)
    try:
        for depth, name in enumerate(parts):
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                mine = depth >= owned_from
                try:
                    os.mkdir(name, DIR_MODE if mine else 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # a concurrent launch made it
                nxt = os.open(name, flags, dir_fd=fd)
                if mine:
                    os.fchmod(nxt, DIR_MODE)  # mkdir's mode is cut by the umask
                    if owner is not None:
                        chown_if_allowed(nxt, owner)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise VolumePathError(f"{name!r} is a symlink or not a folder") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def chown_if_allowed(fd: int, owner: int) -> None:
    """Give a folder or file to the project's uid/gid. Without the right (a portal or agent not
    run as root nor with CAP_CHOWN) the folder stays ours: documented in docs/storage.md."""
    try:
        os.fchown(fd, owner, owner)
    except PermissionError:
        pass


def prepare_dir(root: str, relpath: str, *, owner: int | None) -> str:
    """Make sure ``root``/``relpath`` exists as a real folder (project levels owned by ``owner``)
    and return its host path, for a bind mount or a process sandbox's environment."""
    if not root:
        raise VolumePathError("this node has no volumes root (agent option --volumes-root)")
    parts = split_relpath(relpath)
    if len(parts) < 3:
        raise VolumePathError(f"{relpath!r} is not a project's folder")
    # <org> is shared by the organization's projects: 0755, ours; <project> and below are the project's.
    fd = open_dir(root, parts, create=True, owner=owner, owned_from=1)
    os.close(fd)
    return os.path.join(os.path.realpath(root), *parts)


def project_uid(project_id: int | None, uids: tuple[int, int]) -> int | None:
    """The uid = gid of a project's jobs and files (uids: the node's GPUPORTAL_JOB_UIDS range)."""
    if project_id is None:
        return None
    first, last = uids
    if not 0 <= project_id <= last - first:
        raise VolumePathError(f"project {project_id} has no uid in the range {first}-{last} (GPUPORTAL_JOB_UIDS)")
    return first + project_id


def uid_range_of(raw: str) -> tuple[int, int]:
    """``FIRST-LAST`` as two ints (VolumePathError when malformed)."""
    from agents.sandbox import SandboxError, uid_range

    try:
        return uid_range(raw, "GPUPORTAL_JOB_UIDS")
    except SandboxError as exc:
        raise VolumePathError(str(exc)) from None


def plan_mounts(root: str, volumes: list[dict], checkpoint: dict | None, *,
                owner: int | None) -> tuple[list[tuple[str, str, bool]], str | None, str | None]:
    """A launch's volumes on this node: ``(host, container, read_only)`` binds, the folders made
    (and owned by ``owner``) first, plus the checkpoint folder's container and host paths.

    Without a volumes root a job naming volumes is refused (VolumePathError, said to its owner);
    one naming none just gets no checkpoint folder.
    """
    if not root:
        if volumes:
            raise VolumePathError("this job mounts volumes but the node has no volumes root "
                                  "(agent option --volumes-root)")
        return [], None, None
    binds = []
    for volume in volumes:
        name = volume.get("name") or ""
        if not SLUG.match(name) or split_relpath(volume.get("path") or "")[-1:] != [name]:
            raise VolumePathError(f"volume {name!r}: not a volume's path")
        binds.append((prepare_dir(root, volume["path"], owner=owner), f"{MOUNT_ROOT}/{name}",
                      bool(volume.get("read_only"))))
    if not checkpoint or not checkpoint.get("path"):
        return binds, None, None
    host = prepare_dir(root, checkpoint["path"], owner=owner)
    on = checkpoint.get("volume")
    if on:
        if not any(c == f"{MOUNT_ROOT}/{on}" and not ro for _, c, ro in binds):
            raise VolumePathError(f"checkpoint: volume {on!r} is not mounted writable")
        return binds, f"{MOUNT_ROOT}/{on}/{CHECKPOINTS}/{os.path.basename(host)}", host
    binds.append((host, CHECKPOINT_MOUNT, False))
    return binds, CHECKPOINT_MOUNT, host
