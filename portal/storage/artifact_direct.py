"""Artifacts that go from the node straight to an S3-compatible storage, never through the portal.

With ARTIFACTS_STORAGE=s3 an agent of protocol 1.6 or later asks, per file, for a presigned PUT URL
(``POST /api/agent/v1/jobs/<id>/artifacts/uploads``): the portal checks that this attempt ran on that
node and that the file fits the attempt's limits (ARTIFACTS_MAX_FILES, ARTIFACTS_MAX_MB), chooses the
key (``jobs/<job id>/<attempt>/<path>``, as the relay stores it) and signs a URL for that one key,
valid ARTIFACTS_UPLOAD_PRESIGN_S seconds. The node PUTs the bytes there, then confirms
(``.../artifacts/confirm``): the portal HEADs the object, refuses it when it is missing or its size is
not the size announced (deleting what was there), checks the limits again (two URLs may have been
issued against the same room) and records the artifact.

Where it answers ``{"relay": true}`` (a local storage, ARTIFACTS_UPLOAD_PRESIGN_S=0, an agent older
than 1.6) the agent uploads through the portal (artifacts.artifact_put), as older agents always do.
The SHA-256 recorded is the node's word, as the bytes themselves are: the node that ran the attempt is
the only one that may upload them either way.
"""
import logging
import re

from django.conf import settings
from django.db import transaction

from agents.protocol import DIRECT_ARTIFACTS_SINCE, speaks
from portal.core.errors import Conflict, NotFound, ServiceError
from portal.jobs.models import Job

from . import files
from .artifacts import _job_for_node, _room, storage, storage_key
from .models import Artifact

log = logging.getLogger(__name__)

SHA256 = re.compile(r"[0-9a-f]{64}")


class NotUploaded(ServiceError):
    status = 400
    default_code = "not_uploaded"


def _job(node, job_id, attempt: int):
    """The job, when this attempt of it ran on ``node``; 404 otherwise (to another node the job is
    nobody's business, not even whether it exists)."""
    try:
        return _job_for_node(node, job_id, attempt)
    except Conflict:
        raise NotFound(f"No job {job_id} attempt {attempt} ran on {node.name}.") from None


def direct(node) -> bool:
    """Whether ``node`` uploads its artifacts straight to the storage: an S3-compatible one, presigned
    uploads on, and an agent that knows how."""
    st = storage()
    return bool(settings.ARTIFACTS_UPLOAD_PRESIGN_S and hasattr(st, "bucket_name") and hasattr(st, "connection")
                and speaks(node.protocol_version, DIRECT_ARTIFACTS_SINCE))


def upload_issue(*, node, job_id, attempt: int, path: str, size: int) -> dict:
    """A presigned PUT URL for one file of this attempt's outputs, or ``{"relay": True}``."""
    job = _job(node, job_id, attempt)
    parts = files.check_path(path, allow_top=False)
    relpath = "/".join(parts)
    if not direct(node):
        return {"relay": True}
    _room(job, attempt, relpath, size, field="size")
    ttl = settings.ARTIFACTS_UPLOAD_PRESIGN_S
    url = storage().url(storage_key(job.pk, attempt, parts), expire=ttl, http_method="PUT")
    return {"relay": False, "path": relpath, "size": size, "url": url, "method": "PUT", "expires_in": ttl}


def upload_confirm(*, node, job_id, attempt: int, path: str, size: int, sha256: str) -> dict:
    """Record a file the node PUT at the URL ``upload_issue`` gave: its object must be there with
    ``size`` bytes (a HEAD on the storage), and fit the attempt's limits, or it is refused and deleted."""
    job = _job(node, job_id, attempt)
    parts = files.check_path(path, allow_top=False)
    relpath = "/".join(parts)
    if not SHA256.fullmatch(sha256):
        raise ServiceError("Expected 64 lowercase hexadecimal digits.", field="sha256")
    if not direct(node):
        raise ServiceError("This portal takes this node's artifacts through the relay (PUT .../artifacts).",
                           field="path", code="relay")
    st = storage()
    key = storage_key(job.pk, attempt, parts)
    stored = _stored_size(st, key)
    if stored is None:
        raise NotUploaded(f"{relpath} was not uploaded (no object at its key).", field="path")
    if stored != size:
        _discard(st, key, job, attempt, relpath)
        raise ServiceError(f"{relpath} has {stored} bytes in the storage, not the {size} announced; it was "
                           f"deleted.", field="size", code="size_mismatch")
    with transaction.atomic():
        Job.objects.select_for_update().filter(pk=job.pk).exists()  # one confirm of this job at a time: the limits
        try:
            _room(job, attempt, relpath, size, field="size")
        except ServiceError:
            _discard(st, key, job, attempt, relpath)
            raise
        Artifact.objects.update_or_create(job=job, attempt=attempt, path=relpath, defaults={
            "size": size, "sha256": sha256, "storage_name": key})
    return {"path": relpath, "size": size, "sha256": sha256}


def _stored_size(st, key: str) -> int | None:
    """The object's size from a HEAD, None when there is none."""
    try:
        return st.size(key)
    except FileNotFoundError:  # django-storages' word for a HEAD answered 404
        return None


def _discard(st, key: str, job, attempt: int, relpath: str) -> None:
    """Delete a refused object, and the row of any earlier upload of the path (its bytes are gone)."""
    st.delete(key)
    Artifact.objects.filter(job=job, attempt=attempt, path=relpath).delete()
    log.warning("job %s attempt %s: refused direct upload of %s deleted", job.pk, attempt, relpath)
