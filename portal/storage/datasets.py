"""Datasets: named, versioned, read-only inputs of a project (docs/storage.md, "Datasets").

A version comes from an S3-compatible bucket and prefix, an HTTP(S) URL of one file (a tar archive is
unpacked on the node) or an upload through the portal. It is immutable: a new source is a new version.
Its files (path, size, sha256), total size and digest (agents.datasets.manifest_digest) are read once,
by the `storage.dataset_inspect` task for a bucket or a URL and while the bytes arrive for an upload;
until then it is `pending`, and jobs may name only `ready` versions.

A job names datasets in its spec (`"datasets": ["imagenet@3", "tiny"]`); the submit resolves each to
{name, version, digest, size, source}, kept on the job (Job.datasets), and the launch spec gives the
node where to fetch each file (a presigned URL for a bucket's object, the URL itself, or the portal's
agent API for an upload).
"""
import hashlib
import logging
import re
import tempfile
import urllib.parse
from datetime import timedelta
import urllib.request
from fnmatch import fnmatchcase

from django.conf import settings
from django.core.files import File
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from agents.datasets import NAME, check_file_path, is_archive, manifest_digest
from portal.core.context import Actor
from portal.core.errors import InvalidInput, NotFound
from portal.core.queue import send
from portal.core.services import audit_record
from portal.jobs.models import HOLDING, Job
from portal.tenancy.models import Project

from . import secrets
from .artifacts import storage
from .models import Dataset, DatasetVersion, DatasetVersionState
from .services import TooLarge, _require, refuse_if_named

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
INSPECT_TASK = "storage.dataset_inspect"
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
REF = re.compile(r"(?P<name>[^@]+)(?:@(?P<version>\d{1,9}))?\Z")


# -- checks ---------------------------------------------------------------------------------------


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidInput("Use 1 to 63 lower-case letters, digits, '.', '_' or '-', starting with a letter or digit.",
                           field="name")
    return name


def check_url(url: str, field: str) -> str:
    """An http(s) URL with a host, no login in it (others in the project read it), no control characters
    or spaces, and a host DATASET_SOURCE_HOSTS allows."""
    if not isinstance(url, str) or not url or len(url) > 2000:
        raise InvalidInput("Give an http:// or https:// URL of at most 2000 characters.", field=field)
    if any(ord(c) <= 32 or ord(c) == 127 for c in url):
        raise InvalidInput("A URL may not hold spaces or control characters.", field=field)
    try:
        parts = urllib.parse.urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises ValueError on a bad one
    except ValueError as exc:
        raise InvalidInput(f"Not a URL: {exc}.", field=field) from None
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidInput("Give an http:// or https:// URL with a host.", field=field)
    if parts.username or parts.password:
        raise InvalidInput("A URL may not hold a login (everyone in the project sees it); use a bucket's keys.",
                           field=field)
    allowed = settings.DATASET_SOURCE_HOSTS
    if allowed and not any(fnmatchcase(host.lower(), p) for p in allowed):
        raise InvalidInput(f"Host {host} is not an allowed dataset source here (DATASET_SOURCE_HOSTS: "
                           f"{', '.join(allowed)}).", field=field)
    return url


def check_source(source: dict) -> dict:
    """The `source` of a new version, checked: {"kind": "http", "url"} or {"kind": "s3", "bucket", "prefix",
    "endpoint_url", "region", "access_key", "secret_key"}. Field errors name source.<key>."""
    if not isinstance(source, dict):
        raise InvalidInput("Give an object with kind 'http' or 's3'.", field="source")
    kind = source.get("kind")
    if kind == "http":
        unknown = set(source) - {"kind", "url"}
        if unknown:
            raise InvalidInput(f"Unknown keys for an http source: {', '.join(sorted(unknown))}.", field="source")
        url = check_url(source.get("url"), "source.url")
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]) or "data"
        try:
            check_file_path(name)
        except ValueError:
            name = "data"
        return {"source": "http", "url": url, "archive": is_archive(name), "name": name}
    if kind == "s3":
        known = {"kind", "bucket", "prefix", "endpoint_url", "region", "access_key", "secret_key"}
        unknown = set(source) - known
        if unknown:
            raise InvalidInput(f"Unknown keys for an s3 source: {', '.join(sorted(unknown))}.", field="source")
        for key in known - {"kind"}:
            if source.get(key) is not None and not isinstance(source.get(key), str):
                raise InvalidInput("Expected a string.", field=f"source.{key}")
        bucket = source.get("bucket") or ""
        if not BUCKET.match(bucket):
            raise InvalidInput("A bucket name is 3 to 63 lower-case letters, digits, '.' and '-'.",
                               field="source.bucket")
        prefix = source.get("prefix") or ""
        if len(prefix) > 1024 or prefix.startswith("/") or any(ord(c) < 32 or ord(c) == 127 for c in prefix) \
                or ".." in prefix.split("/"):
            raise InvalidInput("A key prefix of at most 1024 plain characters, not starting with '/', without '..'.",
                               field="source.prefix")
        endpoint = source.get("endpoint_url") or ""
        if endpoint:
            check_url(endpoint, "source.endpoint_url")
        region = source.get("region") or ""
        if len(region) > 64 or not re.fullmatch(r"[a-z0-9-]*", region):
            raise InvalidInput("A region like us-east-1.", field="source.region")
        access, secret = source.get("access_key") or "", source.get("secret_key") or ""
        if bool(access) != bool(secret) or len(access) > 255 or len(secret) > 4096:
            raise InvalidInput("Give both access_key and secret_key, or neither (the portal's own credentials).",
                               field="source.access_key")
        return {"source": "s3", "s3_bucket": bucket, "s3_prefix": prefix, "s3_endpoint": endpoint,
                "s3_region": region, "s3_access_key": access,
                "s3_secret_encrypted": secrets.encrypt(secret) if secret else ""}
    raise InvalidInput("kind must be 'http' or 's3' (an upload goes to PUT .../upload/).", field="source.kind")


# -- writes -------------------------------------------------------------------------------------


def dataset_create(*, actor: Actor, project: Project, name: str, description: str = "",
                   source: dict | None = None) -> Dataset:
    """A new dataset, with version 1 from `source` when given (else versions come later)."""
    _require(actor, "submit", project, "create datasets")
    check_name(name)
    checked = check_source(source) if source is not None else None
    try:
        with transaction.atomic():
            dataset = Dataset.objects.create(project=project, name=name, description=description,
                                             created_by=actor.user)
            audit_record(actor=actor, action="dataset.create", obj=dataset, project=project)
            if checked is not None:
                _new_version(actor, dataset, checked)
    except IntegrityError:
        raise InvalidInput(f"Project {project.slug} already has a dataset named {name!r}.", field="name") from None
    return dataset


def dataset_version_add(*, actor: Actor, dataset: Dataset, source: dict) -> DatasetVersion:
    """The next version of `dataset` from `source`, pending until its files are read."""
    _require(actor, "submit", dataset.project, "add dataset versions")
    checked = check_source(source)
    with transaction.atomic():
        return _new_version(actor, dataset, checked)


def _new_version(actor: Actor, dataset: Dataset, checked: dict) -> DatasetVersion:
    """Call inside a transaction. Numbers follow the highest so far (a row lock on the dataset)."""
    Dataset.objects.select_for_update().filter(pk=dataset.pk).first()
    last = dataset.versions.order_by("-version").values_list("version", flat=True).first() or 0
    fields = {k: v for k, v in checked.items() if k != "name"}
    version = DatasetVersion.objects.create(dataset=dataset, version=last + 1, created_by=actor.user, **fields)
    audit_record(actor=actor, action="dataset.version", obj=dataset, project=dataset.project,
                 version=version.version, source=version.source_text)
    if version.source != "upload":  # read by the portal's worker (storage/tasks.py), on the default queue
        transaction.on_commit(lambda: send(INSPECT_TASK, args=[version.pk], queue="default"))
    return version


def dataset_upload(*, actor: Actor, dataset: Dataset, filename: str, stream, length: int | None) -> DatasetVersion:
    """A new version from the request body: one file (a tar archive is unpacked on the node), hashed
    while it is spooled, then kept in the artifacts storage under datasets/<dataset>/<version>/."""
    _require(actor, "submit", dataset.project, "upload datasets")
    try:
        check_file_path(filename)
    except ValueError as exc:
        raise InvalidInput(f"{exc}.", field="filename") from None
    if "/" in filename:
        raise InvalidInput("A file name, not a path.", field="filename")
    limit = settings.DATASET_UPLOAD_MAX_MB * 1024 * 1024
    if length is not None and length > limit:
        raise TooLarge(f"The file of {length} bytes exceeds the upload limit of {settings.DATASET_UPLOAD_MAX_MB} MB.",
                       field="file")
    h, size = hashlib.sha256(), 0
    with tempfile.TemporaryFile() as spool:
        while chunk := stream.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"The file exceeds the upload limit of {settings.DATASET_UPLOAD_MAX_MB} MB.",
                               field="file")
            h.update(chunk)
            spool.write(chunk)
        spool.seek(0)
        files = [{"path": filename, "size": size, "sha256": h.hexdigest()}]
        with transaction.atomic():
            version = _new_version(actor, dataset, {"source": "upload", "url": filename,
                                                    "archive": is_archive(filename)})
            name = storage().save(f"datasets/{dataset.pk}/{version.version}/{filename}", File(spool))
            version.storage_name = name
            version.save(update_fields=["storage_name"])
            _ready(version, files)
    return version


def dataset_delete(*, actor: Actor, dataset: Dataset) -> None:
    """Remove a dataset no job not yet ended names (409 dataset_in_use), with its uploads."""
    _require(actor, "manage", dataset.project, "delete datasets")
    refuse_if_named(dataset.project, "datasets", dataset.name, "dataset")
    uploads = list(dataset.versions.exclude(storage_name="").values_list("storage_name", flat=True))
    with transaction.atomic():
        audit_record(actor=actor, action="dataset.delete", obj=dataset, project=dataset.project)
        dataset.delete()
    for name in uploads:
        try:
            storage().delete(name)
        except Exception:  # the row is gone; an orphan file is an operator's clean-up, never a 500
            log.exception("dataset upload %s was not deleted", name)


def _ready(version: DatasetVersion, files: list[dict]) -> None:
    """Files known: [{path, size, sha256}] (and each bucket object's key), their size and digest."""
    version.files = files
    version.size = sum(f["size"] for f in files)
    version.digest = manifest_digest(files)
    version.state = DatasetVersionState.READY
    version.message = ""
    version.save(update_fields=["files", "size", "digest", "state", "message"])


# -- reading a source -------------------------------------------------------------------------------


def _s3_client(version: DatasetVersion):
    # Here, not at the top: boto3 takes over half a second to import, every portal process loads this
    # module, and only a version read from S3 needs it.
    import boto3
    from botocore.config import Config

    kwargs = {"config": Config(signature_version="s3v4", retries={"max_attempts": 3}),
              "region_name": version.s3_region or "us-east-1"}
    if version.s3_endpoint:
        kwargs["endpoint_url"] = version.s3_endpoint
    if version.s3_access_key:
        kwargs.update(aws_access_key_id=version.s3_access_key,
                      aws_secret_access_key=secrets.decrypt(version.s3_secret_encrypted))
    return boto3.client("s3", **kwargs)


def _hash_stream(read) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    while chunk := read(CHUNK):
        n += len(chunk)
        h.update(chunk)
    return n, h.hexdigest()


def _s3_files(version: DatasetVersion) -> list[dict]:
    client = _s3_client(version)
    files = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=version.s3_bucket, Prefix=version.s3_prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.endswith("/"):
                continue  # a "folder" marker
            path = key[len(version.s3_prefix):].lstrip("/")
            try:
                check_file_path(path)
            except ValueError as exc:
                raise ValueError(f"object {key[:200]!r}: {exc}") from None
            if len(files) >= settings.DATASET_MAX_FILES:
                raise ValueError(f"more than {settings.DATASET_MAX_FILES} objects below the prefix (DATASET_MAX_FILES)")
            body = client.get_object(Bucket=version.s3_bucket, Key=key)["Body"]
            size, digest = _hash_stream(body.read)
            files.append({"path": path, "size": size, "sha256": digest, "key": key})
    if not files:
        raise ValueError(f"no objects below s3://{version.s3_bucket}/{version.s3_prefix}")
    return files


def _http_files(version: DatasetVersion) -> list[dict]:
    name = urllib.parse.unquote(urllib.parse.urlsplit(version.url).path.rstrip("/").rsplit("/", 1)[-1]) or "data"
    try:
        check_file_path(name)
    except ValueError:
        name = "data"
    with urllib.request.urlopen(version.url, timeout=60) as resp:
        size, digest = _hash_stream(resp.read)
    return [{"path": name, "size": size, "sha256": digest}]


def dataset_version_inspect(version_id: int) -> DatasetVersion | None:
    """Read a pending version's source: its files, size and digest; `failed` with the reason when it
    cannot be read. Idempotent: a version no longer pending, or one another worker began reading less
    than DATASET_INSPECT_STALE_S ago, is left alone (None)."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.DATASET_INSPECT_STALE_S)
    if not DatasetVersion.objects.filter(Q(inspect_started_at__isnull=True) | Q(inspect_started_at__lt=stale),
                                         pk=version_id, state=DatasetVersionState.PENDING
                                         ).update(inspect_started_at=now):
        return None
    version = DatasetVersion.objects.get(pk=version_id)
    try:
        files = _s3_files(version) if version.source == "s3" else _http_files(version)
    except Exception as exc:  # the source's own errors (HTTP, S3, network, a bad key), said to its owner
        why = str(exc) or type(exc).__name__
        log.info("dataset version %s could not be read: %s", version_id, why)
        DatasetVersion.objects.filter(pk=version.pk, state=DatasetVersionState.PENDING).update(
            state=DatasetVersionState.FAILED, message=f"could not read the source: {why}"[:500])
        version.refresh_from_db()
        return version
    with transaction.atomic():
        version = DatasetVersion.objects.select_for_update().get(pk=version.pk)
        if version.state == DatasetVersionState.PENDING:
            _ready(version, files)
    return version


def dataset_inspect_pending(older_than_s: float = 60.0) -> int:
    """Read the pending versions nobody reads: made more than `older_than_s` ago and never begun (their
    task was lost), or begun more than DATASET_INSPECT_STALE_S ago (their worker died). -> how many."""
    now = timezone.now()
    ids = list(DatasetVersion.objects.filter(
        Q(inspect_started_at__isnull=True, created_at__lt=now - timedelta(seconds=older_than_s))
        | Q(inspect_started_at__lt=now - timedelta(seconds=settings.DATASET_INSPECT_STALE_S)),
        state=DatasetVersionState.PENDING).order_by("pk").values_list("pk", flat=True)[:100])
    return sum(1 for pk in ids if dataset_version_inspect(pk) is not None)


# -- for jobs -------------------------------------------------------------------------------------


def resolve_job_datasets(project: Project, refs: list[str], sandbox: str | None) -> tuple[list[dict], dict]:
    """A job spec's `datasets` (["imagenet@3", "tiny"]: a version, or the latest ready one) as
    [{name, version, digest, size, source}], and field errors ({"datasets.<n>": [...]}). A dataset of
    another project is not there: the same message as one that does not exist. Every sandbox mounts
    them (kvm over virtio-9p), so ``sandbox`` changes nothing."""
    if not refs:
        return [], {}
    errors: dict[str, list[str]] = {}
    parsed = []
    for index, ref in enumerate(refs):
        m = REF.match(ref) if isinstance(ref, str) else None
        if m is None or not NAME.match(m["name"]):
            errors[f"datasets.{index}"] = ["Name a dataset as 'name' (its latest ready version) or 'name@version'."]
            continue
        parsed.append((index, m["name"], int(m["version"]) if m["version"] else None))
    names = {name for _, name, _ in parsed}
    by_name: dict[str, list[DatasetVersion]] = {}
    for v in DatasetVersion.objects.filter(dataset__project=project, dataset__name__in=names).select_related(
            "dataset").order_by("-version"):
        by_name.setdefault(v.dataset.name, []).append(v)
    out, seen = [], set()
    for index, name, number in parsed:
        key = f"datasets.{index}"
        versions = by_name.get(name)
        if name in seen:
            errors[key] = [f"Dataset {name!r} is named twice."]
            continue
        seen.add(name)
        if not versions and not Dataset.objects.filter(project=project, name=name).exists():
            errors[key] = [f"Project {project.slug} has no dataset named {name!r}."]
            continue
        if number is None:
            chosen = next((v for v in versions or () if v.state == DatasetVersionState.READY), None)
            if chosen is None:
                errors[key] = [f"Dataset {name!r} has no ready version yet."]
                continue
        else:
            chosen = next((v for v in versions or () if v.version == number), None)
            if chosen is None:
                errors[key] = [f"Dataset {name!r} has no version {number}."]
                continue
            if chosen.state != DatasetVersionState.READY:
                errors[key] = [f"{name}@{number} is {chosen.state}"
                               + (f": {chosen.message}" if chosen.message else " (its source is still being read).")]
                continue
        out.append({"name": name, "version": chosen.version, "digest": chosen.digest, "size": chosen.size,
                    "source": chosen.source_text})
    return out, errors


def launch_datasets(refs_by_job: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """For each job naming datasets (its id: Job.datasets, the references resolved at submit), what
    its node fetches: [{name, version, digest, size, archive, files: [{path, size, sha256, url}]}].
    Bucket objects get presigned URLs valid DATASET_URL_TTL_S (made at launch time); uploads are
    fetched from the portal's agent API with the node's token."""
    return {job_id: _fetch_entries(refs) for job_id, refs in refs_by_job.items() if refs}


def prefetch_entries(digests) -> list[dict]:
    """What a node fetches to hold these versions ahead of a job (the agent task agent.prefetch takes
    it): entries as in a launch spec's `datasets`, for the ready versions among `digests`."""
    refs = [{"name": v.dataset.name, "version": v.version, "digest": v.digest}
            for v in DatasetVersion.objects.filter(digest__in=list(digests), state=DatasetVersionState.READY)
            .select_related("dataset").order_by("pk")]
    return _fetch_entries(list({r["digest"]: r for r in refs}.values()))


def _fetch_entries(refs: list[dict]) -> list[dict]:
    versions = {}
    for v in DatasetVersion.objects.filter(digest__in={d["digest"] for d in refs}, state=DatasetVersionState.READY
                                           ).order_by("pk"):
        versions.setdefault(v.digest, v)
    clients, entries = {}, []
    for d in refs:
        v = versions.get(d["digest"])
        if v is None:
            continue  # deleted since the submit: nothing to fetch it from (the job fails on the node)
        files = []
        for f in v.files:
            if v.source == "s3":
                client = clients.get(v.pk) or clients.setdefault(v.pk, _s3_client(v))
                url = client.generate_presigned_url("get_object", Params={"Bucket": v.s3_bucket, "Key": f["key"]},
                                                    ExpiresIn=settings.DATASET_URL_TTL_S)
            elif v.source == "upload":
                url = f"agent:datasets/{v.digest}/file"
            else:
                url = v.url
            files.append({"path": f["path"], "size": f["size"], "sha256": f["sha256"], "url": url})
        entries.append({"name": d["name"], "version": d["version"], "digest": v.digest, "size": v.size,
                        "archive": v.archive, "files": files})
    return entries


def upload_for_node(*, node, digest: str):
    """(file, size, name) of an uploaded version's file for a node that holds a job naming it (assigned,
    starting or running there); NotFound otherwise."""
    v = DatasetVersion.objects.filter(digest=digest, source="upload", state=DatasetVersionState.READY).first()
    here = Q(node=node) | Q(allocations__gpu__node=node, allocations__released_at__isnull=True)
    if v is None or not Job.objects.filter(here, state__in=HOLDING, datasets__contains=[{"digest": digest}]).exists():
        raise NotFound("No such dataset file for a job of this node.")
    f = v.files[0]
    return storage().open(v.storage_name, "rb"), f["size"], f["path"]
