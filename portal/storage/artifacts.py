"""Job artifacts: the files an attempt of a job leaves in ``/outputs``.

The node's agent uploads them when the attempt ends, whatever the end (succeeded, failed, timeout,
cancelled, preempted), before its terminal report (agents/artifacts.py). They are kept in the
artifacts storage (``STORAGES["artifacts"]`` through django-storages: a local folder by default, an
S3-compatible bucket with ARTIFACTS_STORAGE=s3) under ``jobs/<job id>/<attempt>/<path>``, and listed
and downloaded through the job (so whoever may see the job may read them, and nobody else).

Paths are checked as a volume's are (storage/files.py): relative, no ``..``, no control characters.
One attempt keeps at most ARTIFACTS_MAX_FILES files and ARTIFACTS_MAX_MB in all: past either the
upload is refused with 413, saying which.

Retention: an artifact is kept ``retention_days`` after its upload (the project's
Quota.artifact_retention_days, else ARTIFACTS_RETENTION_DAYS; 0 keeps it forever); the
storage.artifacts_expire beat task deletes the expired ones (file, then row, one audit event per job).
Downloads from an S3-compatible storage answer with a redirect to a presigned URL
(ARTIFACTS_PRESIGN_S seconds), so that large files never pass through the portal.
"""
import hashlib
import logging
import tempfile
from datetime import timedelta

from django.conf import settings
from django.core.files import File
from django.core.files.storage import storages
from django.db import transaction
from django.db.models import Count, Sum
from django.http import FileResponse, HttpResponseRedirect
from django.utils import timezone
from django.utils.http import content_disposition_header

from portal.core.context import SYSTEM
from portal.core.errors import Conflict, NotFound, ServiceError
from portal.core.numbers import parse_int
from portal.core.services import audit_record
from portal.jobs.models import Allocation, Job
from portal.jobs.reports import job_nodes
from portal.tenancy.models import Project
from portal.tenancy.selectors import artifact_retention_days as retention_days

from . import files
from .models import Artifact
from .services import TooLarge

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
MB = 1024 * 1024


class LengthRequired(ServiceError):
    status = 411
    default_code = "length_required"


def storage():
    return storages["artifacts"]


def storage_key(job_id: int, attempt: int, parts: list[str]) -> str:
    return "/".join(["jobs", str(job_id), str(attempt), *parts])


def _job_for_node(node, job_id, attempt: int):
    """The job, when this attempt of it ran on ``node`` (it may have ended or been preempted since:
    the agent uploads after the stop). Otherwise Conflict (409): the agent gives the upload up."""
    pk = parse_int(job_id)
    job = Job.objects.select_related("node").filter(pk=pk).first() if pk is not None else None
    if job is None:
        raise Conflict(f"No job {job_id}.", code="stale")
    ran_here = (job.attempt == attempt and (job.node_id == node.pk or node.name in job_nodes(job))) or \
        Allocation.objects.filter(job=job, attempt=attempt, gpu__node=node).exists()
    if not ran_here:
        raise Conflict(f"Job {job_id} attempt {attempt} did not run on {node.name}.", code="stale")
    return job


def _room(job, attempt: int, relpath: str, length: int, field: str = "file") -> tuple[int, str]:
    """The bytes this attempt may still keep besides ``relpath`` (what it replaces does not count), and
    how the refusal starts; TooLarge (413) when one more file, or ``length`` bytes, is past the limits."""
    others = Artifact.objects.filter(job=job, attempt=attempt).exclude(path=relpath).aggregate(
        n=Count("id"), size=Sum("size"))
    if others["n"] >= settings.ARTIFACTS_MAX_FILES:
        raise TooLarge(f"Job {job.pk} attempt {attempt} already has {others['n']} artifacts, the most one attempt "
                       f"may keep (ARTIFACTS_MAX_FILES).", field="path", code="artifacts_too_many")
    room = settings.ARTIFACTS_MAX_MB * MB - (others["size"] or 0)
    over = (f"The artifacts of job {job.pk} attempt {attempt} would exceed the limit of "
            f"{settings.ARTIFACTS_MAX_MB} MB per attempt (ARTIFACTS_MAX_MB)")
    if length > room:
        raise TooLarge(f"{over}: {relpath} has {length} bytes, {max(room, 0)} are left.", field=field,
                       code="artifacts_too_large")
    return room, over


def artifact_put(*, node, job_id, attempt: int, path: str, stream, length: int | None) -> dict:
    """Store one file of an attempt's outputs from ``stream`` (replacing the same path: a retried
    upload). The bytes are spooled to a temporary file first (counted and hashed there), so a refused
    or broken upload stores nothing."""
    job = _job_for_node(node, job_id, attempt)
    parts = files.check_path(path, allow_top=False)
    if length is None:  # WSGI reads no body without it (a chunked one would be stored empty)
        raise LengthRequired("Send the file's size as Content-Length.", field="file")
    relpath = "/".join(parts)
    room, over = _room(job, attempt, relpath, length)
    digest = hashlib.sha256()
    size = 0
    with tempfile.TemporaryFile() as spool:
        while chunk := stream.read(CHUNK):
            size += len(chunk)
            if size > room:
                raise TooLarge(f"{over}: {relpath} is larger than the {max(room, 0)} bytes left.", field="file",
                               code="artifacts_too_large")
            digest.update(chunk)
            spool.write(chunk)
        if size != length:
            raise ServiceError(f"The upload ended after {size} of {length} bytes.", field="file", code="incomplete")
        spool.seek(0)
        key = storage_key(job.pk, attempt, parts)
        old = Artifact.objects.filter(job=job, attempt=attempt, path=relpath).first()
        st = storage()
        if old is not None or st.exists(key):  # a retry: the new bytes replace the old (never a renamed copy)
            st.delete(old.storage_name if old is not None else key)
        name = st.save(key, File(spool, name=parts[-1]))
    with transaction.atomic():
        Artifact.objects.update_or_create(job=job, attempt=attempt, path=relpath, defaults={
            "size": size, "sha256": digest.hexdigest(), "storage_name": name})
    return {"path": relpath, "size": size, "sha256": digest.hexdigest()}


def artifacts_of(job, attempt: int | None = None):
    qs = Artifact.objects.filter(job=job)
    return qs.filter(attempt=attempt) if attempt is not None else qs


def _presigned(artifact: Artifact) -> str | None:
    """A short-lived URL the S3-compatible storage itself serves the file at, as an attachment; None
    where the storage is not S3 (a local folder) or presigning is off (ARTIFACTS_PRESIGN_S=0)."""
    st = storage()
    if not settings.ARTIFACTS_PRESIGN_S or not hasattr(st, "bucket_name") or not hasattr(st, "connection"):
        return None
    filename = artifact.path.rsplit("/", 1)[-1]
    return st.url(artifact.storage_name, expire=settings.ARTIFACTS_PRESIGN_S, parameters={
        "ResponseContentDisposition": content_disposition_header(True, filename),  # as FileResponse says it
        "ResponseContentType": "application/octet-stream"})


def artifact_response(artifact: Artifact):
    """The artifact as an attachment: on S3, a redirect (302) to a presigned URL; otherwise streamed
    from the storage (never rendered by the browser). The caller has checked the tenant already."""
    url = _presigned(artifact)
    if url is not None:
        response = HttpResponseRedirect(url)
        response["X-Checksum-Sha256"] = artifact.sha256
        response["Cache-Control"] = "no-store"  # the URL is a bearer secret for its lifetime
        return response
    try:
        handle = storage().open(artifact.storage_name, "rb")
    except (FileNotFoundError, OSError) as exc:
        log.error("artifact %s (%s) is missing from the storage: %s", artifact.pk, artifact.storage_name, exc)
        raise NotFound("This artifact's file is missing from the storage.") from None
    response = FileResponse(handle, as_attachment=True, filename=artifact.path.rsplit("/", 1)[-1],
                            content_type="application/octet-stream")
    response["Content-Length"] = str(artifact.size)
    response["X-Checksum-Sha256"] = artifact.sha256
    return response


def artifact_summary(job) -> dict:
    """Per attempt: how many files and bytes (the job page's headline)."""
    rows = Artifact.objects.filter(job=job).values("attempt").annotate(n=Count("id"), size=Sum("size"))
    return {r["attempt"]: {"files": r["n"], "size": r["size"] or 0} for r in rows}



def expires_at(artifact: Artifact, days: int):
    """When the beat task deletes ``artifact`` (None: never)."""
    return artifact.created_at + timedelta(days=days) if days else None


def project_artifact_totals(project) -> dict:
    """What the project's jobs keep as artifacts: files and bytes."""
    row = Artifact.objects.filter(job__project=project).aggregate(n=Count("id"), size=Sum("size"))
    return {"files": row["n"], "size": row["size"] or 0}


def artifacts_expire(now=None) -> dict:
    """Delete the artifacts past their project's retention: the stored file first, then the row, one
    audit event (artifacts.expire) per job. Idempotent: a second run, or one racing this one, finds
    nothing more to do (rows are claimed with SKIP LOCKED). A file the storage fails to delete keeps
    its row, for the next run. -> {"files": n, "bytes": n, "jobs": n}."""
    now = now or timezone.now()
    done = {"files": 0, "bytes": 0, "jobs": 0}
    st = storage()
    for project in Project.objects.select_related("quota").order_by("pk"):
        days = retention_days(project)
        if not days:
            continue
        cutoff = now - timedelta(days=days)
        job_ids = (Artifact.objects.filter(job__project=project, created_at__lt=cutoff)
                   .values_list("job_id", flat=True).distinct().order_by("job_id"))
        for job_id in list(job_ids):
            with transaction.atomic():
                rows = list(Artifact.objects.select_for_update(skip_locked=True)
                            .filter(job_id=job_id, created_at__lt=cutoff).order_by("attempt", "path"))
                deleted = []
                for a in rows:
                    try:
                        st.delete(a.storage_name)  # a file already gone is no error
                    except Exception as exc:  # the storage is down or refuses: the row stays for the next run
                        log.error("artifact %s (%s): delete failed: %s", a.pk, a.storage_name, exc)
                        continue
                    deleted.append(a)
                if not deleted:
                    continue
                Artifact.objects.filter(pk__in=[a.pk for a in deleted]).delete()
                size = sum(a.size for a in deleted)
                audit_record(actor=SYSTEM, action="artifacts.expire", obj=Job.objects.only("id", "name").get(pk=job_id),
                             project=project, files=len(deleted), bytes=size, retention_days=days)
                done["files"] += len(deleted)
                done["bytes"] += size
                done["jobs"] += 1
    return done
