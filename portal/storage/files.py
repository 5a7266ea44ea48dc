"""Paths inside a volume as the API takes them: checked, then walked without following symlinks.

A path is relative to the volume (``""`` is its top). Refused with a field message on ``path``:
NUL, absolute paths, ``..``, control characters, over-long names, and any symlink on the way
(a job may plant one pointing at another tenant's folder: it is never followed).
"""
import os
import stat

from django.conf import settings
from django.http import FileResponse

from agents.sandbox.volumes import VolumePathError, open_dir, project_uid, split_relpath, uid_range_of, volume_relpath
from portal.core.errors import InvalidInput, NotFound

MAX_PATH = 1024
MAX_NAME = 255


def root() -> str:
    return str(settings.VOLUMES_ROOT)


def volume_parts(volume) -> list[str]:
    project = volume.project
    return volume_relpath(project.organization.slug, project.slug, volume.name).split("/")


def project_owner(project) -> int | None:
    """The uid = gid the project's jobs run under on docker nodes (settings.JOB_UIDS)."""
    return project_uid(project.pk, uid_range_of(settings.JOB_UIDS))


def check_path(path, *, allow_top: bool) -> list[str]:
    """The path's components, or InvalidInput naming field ``path``."""
    if not isinstance(path, str):
        raise InvalidInput("Expected a string.", field="path")
    if len(path) > MAX_PATH:
        raise InvalidInput(f"At most {MAX_PATH} characters.", field="path")
    try:
        parts = split_relpath(path)
    except VolumePathError as exc:
        raise InvalidInput(f"{str(exc)[0].upper()}{str(exc)[1:]}.", field="path") from None
    for part in parts:
        if len(part.encode()) > MAX_NAME:
            raise InvalidInput(f"A name may have at most {MAX_NAME} bytes.", field="path")
        if any(ord(c) < 32 or ord(c) == 127 for c in part):
            raise InvalidInput("Names may not contain control characters.", field="path")
    if not parts and not allow_top:
        raise InvalidInput("Name a file inside the volume.", field="path")
    return parts


def open_volume_dir(volume, parts: list[str], *, create: bool = False) -> int:
    """A descriptor of a folder inside the volume; NotFound / InvalidInput on ``path``."""
    try:
        top = open_dir(root(), volume_parts(volume), create=True, owner=project_owner(volume.project),
                       owned_from=1)
    except VolumePathError as exc:
        raise InvalidInput(str(exc), field="path") from None
    try:
        return open_dir_at(top, parts, create=create, owner=project_owner(volume.project))
    finally:
        os.close(top)


def open_dir_at(fd: int, parts: list[str], *, create: bool, owner: int | None) -> int:
    try:
        return open_dir(fd, parts, create=create, owner=owner)
    except VolumePathError:
        raise InvalidInput("The path goes through a symlink or a file; symlinks are not followed.",
                           field="path") from None
    except FileNotFoundError:
        raise NotFound("No such folder in this volume.", field="path") from None


def entry(name: str, st: os.stat_result) -> dict:
    kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else \
        "symlink" if stat.S_ISLNK(st.st_mode) else "other"
    return {"name": name, "type": kind, "size": st.st_size if kind == "file" else None,
            "modified": int(st.st_mtime)}


def usage_bytes(volume) -> int:
    """Bytes of regular files in the volume (symlinks not followed)."""
    base = os.path.join(root(), *volume_parts(volume))
    total = 0
    for dirpath, _dirs, names in os.walk(base, followlinks=False):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def download_response(handle, size: int, name: str) -> FileResponse:
    """A volume's file as an attachment: never rendered by the browser whatever it holds."""
    response = FileResponse(handle, as_attachment=True, filename=name, content_type="application/octet-stream")
    response["Content-Length"] = str(size)
    return response
