"""Reads on volumes: list a folder, open a file; paths checked by files.check_path."""
import os
import stat

from portal.core.errors import InvalidInput, NotFound

from . import files
from .models import Volume
# What jobs ask of datasets (the job spec and the launch spec reach them here).
from .datasets import launch_datasets, prefetch_entries, resolve_job_datasets  # noqa: F401

MAX_ENTRIES = 1000


def volumes_for_list(*, user, restricted_project_id=None, project: str = ""):
    qs = Volume.objects.for_user(user, "view", project_id=restricted_project_id).select_related(
        "project__organization", "created_by")
    return qs.filter(project__slug=project) if project else qs


def volume_list_dir(*, volume: Volume, path: str) -> dict:
    """The entries of one folder (dirs first, then by name; at most MAX_ENTRIES)."""
    parts = files.check_path(path, allow_top=True)
    fd = files.open_volume_dir(volume, parts)
    try:
        entries = []
        with os.scandir(fd) as it:
            for item in it:
                if item.name.startswith(".upload-"):
                    continue  # an upload in progress
                entries.append(files.entry(item.name, item.stat(follow_symlinks=False)))
    finally:
        os.close(fd)
    entries.sort(key=lambda e: (e["type"] != "dir", e["name"]))
    return {"path": "/".join(parts), "entries": entries[:MAX_ENTRIES], "truncated": len(entries) > MAX_ENTRIES}


def volume_file_open(*, volume: Volume, path: str):
    """(binary file object, size, name) of a regular file in the volume, never through a symlink."""
    parts = files.check_path(path, allow_top=False)
    folder = files.open_volume_dir(volume, parts[:-1])
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder)
        except FileNotFoundError:
            raise NotFound("No such file in this volume.", field="path") from None
        except OSError:
            raise InvalidInput("This is a symlink; symlinks are not followed.", field="path") from None
    finally:
        os.close(folder)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InvalidInput("Not a file (a folder or a special file).", field="path")
    return os.fdopen(fd, "rb"), st.st_size, parts[-1]


def project_volume_names(project) -> set[str]:
    """The names a job of ``project`` may mount (the job spec checks them)."""
    return set(Volume.objects.filter(project=project).values_list("name", flat=True))
