"""Writes on volumes: create, delete, upload. Folders per agents/sandbox/volumes.py."""
import os
import shutil
import stat
import uuid

from django.conf import settings
from django.db import IntegrityError, transaction

from portal.core.context import Actor
from agents.sandbox.volumes import chown_if_allowed
from portal.core.errors import Conflict, Forbidden, InvalidInput, ServiceError
from portal.core.services import audit_record
from portal.jobs.models import ACTIVE, Job
from portal.tenancy.access import check_token_project, user_can
from portal.tenancy.models import Project

from . import files
from . import secrets
from .models import RegistryCredential, Volume

CHUNK = 1024 * 1024


class QuotaExceeded(ServiceError):
    """An upload that would take a volume over its size quota."""

    status = 413
    default_code = "volume_quota_exceeded"


class TooLarge(ServiceError):
    status = 413
    default_code = "payload_too_large"


def _require(actor: Actor, action: str, project: Project, what: str) -> None:
    check_token_project(actor, project)
    if not user_can(actor.user, action, project):
        role = "owner or admin" if action == "manage" else "owner, admin or member"
        raise Forbidden(f"You need the {role} role in project {project.slug} to {what}.")


def volume_create(*, actor: Actor, project: Project, name: str, quota_mb: int | None = None) -> Volume:
    """A new volume and its folder, owned by the project's uid (made now, so a job finds it)."""
    _require(actor, "manage", project, "create volumes")
    if Volume.objects.filter(project=project, name=name).exists():
        raise InvalidInput(f"Project {project.slug} already has a volume named {name!r}.", field="name")
    try:
        with transaction.atomic():
            volume = Volume.objects.create(project=project, name=name, created_by=actor.user,
                                           **({"quota_mb": quota_mb} if quota_mb is not None else {}))
            os.close(files.open_volume_dir(volume, [], create=True))
            audit_record(actor=actor, action="volume.create", obj=volume, project=project, quota_mb=volume.quota_mb)
    except IntegrityError:
        raise InvalidInput(f"Project {project.slug} already has a volume named {name!r}.", field="name") from None
    return volume


def refuse_if_named(project, field: str, name: str, what: str) -> None:
    """Conflict `<what>_in_use` when a job of `project` not yet ended names `name` in its `field`
    (volumes, datasets): deleting it would pull it from under them."""
    users = Job.objects.filter(project=project, state__in=ACTIVE, **{f"{field}__contains": [{"name": name}]})
    if users.exists():
        ids = ", ".join(str(pk) for pk in users.values_list("pk", flat=True)[:5])
        raise Conflict(f"{what.capitalize()} {name} is named by jobs not yet ended ({ids}); cancel them or wait.",
                       code=f"{what}_in_use")


def volume_delete(*, actor: Actor, volume: Volume) -> None:
    """Remove the volume and every file in it (rmtree does not follow symlinks)."""
    _require(actor, "manage", volume.project, "delete volumes")
    refuse_if_named(volume.project, "volumes", volume.name, "volume")
    base = os.path.join(files.root(), *files.volume_parts(volume))
    with transaction.atomic():
        audit_record(actor=actor, action="volume.delete", obj=volume, project=volume.project)
        volume.delete()
    # After the commit: a failed removal leaves an orphan folder, never a row without its folder.
    shutil.rmtree(base, ignore_errors=True)


def volume_file_put(*, actor: Actor, volume: Volume, path: str, stream, length: int | None) -> dict:
    """Write one file from ``stream`` (at most VOLUME_UPLOAD_MAX_MB, within the volume's quota).

    The bytes go to a hidden temporary name first and are renamed into place at the end, so a
    refused or broken upload leaves nothing behind and never half of a file.
    """
    _require(actor, "submit", volume.project, "upload files")
    parts = files.check_path(path, allow_top=False)
    limit = settings.VOLUME_UPLOAD_MAX_MB * 1024 * 1024
    if length is not None and length > limit:
        raise TooLarge(f"The file of {length} bytes exceeds the upload limit of {settings.VOLUME_UPLOAD_MAX_MB} MB.",
                       field="file")
    room = volume.quota_mb * 1024 * 1024 - files.usage_bytes(volume)
    owner = files.project_owner(volume.project)
    folder = files.open_volume_dir(volume, parts[:-1], create=True)
    tmp = f".upload-{uuid.uuid4().hex}"
    try:
        try:
            st = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise InvalidInput("A folder or a symlink has this name; only files are replaced.", field="path")
        room += st.st_size if st is not None else 0
        if length is not None and length > room:
            raise QuotaExceeded(f"Volume {volume.name} would exceed its quota of {volume.quota_mb} MB "
                                f"({max(room, 0)} bytes free).", field="file")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660, dir_fd=folder)
        written = 0
        try:
            while chunk := stream.read(CHUNK):
                written += len(chunk)
                if written > limit:
                    raise TooLarge(f"The file exceeds the upload limit of {settings.VOLUME_UPLOAD_MAX_MB} MB.",
                                   field="file")
                if written > room:
                    raise QuotaExceeded(f"Volume {volume.name} would exceed its quota of {volume.quota_mb} MB.",
                                        field="file")
                os.write(fd, chunk)
            if owner is not None:
                chown_if_allowed(fd, owner)
            os.fchmod(fd, 0o660)
        finally:
            os.close(fd)
        os.rename(tmp, parts[-1], src_dir_fd=folder, dst_dir_fd=folder)
        tmp = None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=folder)
            except FileNotFoundError:
                pass
        os.close(folder)
    audit_record(actor=actor, action="volume.upload", obj=volume, project=volume.project, path="/".join(parts),
                 size=written)
    return {"path": "/".join(parts), "size": written}


def registry_credential_set(*, actor: Actor, project: Project, registry: str, username: str,
                            secret: str) -> RegistryCredential:
    """The project's login to `registry` (replacing an earlier one): the secret is encrypted at
    rest and never shown again."""
    _require(actor, "manage", project, "set registry credentials")
    with transaction.atomic():
        cred, created = RegistryCredential.objects.update_or_create(
            project=project, registry=registry,
            defaults={"username": username, "secret_encrypted": secrets.encrypt(secret), "created_by": actor.user})
        audit_record(actor=actor, action="registry_credential.set", obj=cred, project=project,
                     registry=registry, username=username, replaced=not created)
    return cred


def registry_credential_delete(*, actor: Actor, credential: RegistryCredential) -> None:
    _require(actor, "manage", credential.project, "delete registry credentials")
    with transaction.atomic():
        audit_record(actor=actor, action="registry_credential.delete", obj=credential, project=credential.project,
                     registry=credential.registry)
        credential.delete()
