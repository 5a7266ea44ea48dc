from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models

from portal.tenancy.models import TenantQuerySet, slug_validator


class Volume(models.Model):
    """A project's persistent folder, ``<VOLUMES_ROOT>/<org>/<project>/<name>`` on the portal and on
    every node, mounted into the project's jobs at ``/data/<name>`` (agents/sandbox/volumes.py)."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.PROTECT, related_name="volumes")
    name = models.SlugField(max_length=50, validators=[slug_validator])
    # Uploads through the portal stop at this size; jobs write to the shared filesystem directly,
    # where the operator's own quota (if any) applies.
    quota_mb = models.PositiveIntegerField(default=10240, validators=[MinValueValidator(1)])
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["project_id", "name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="volume_unique_name_per_project")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.name}"


class Artifact(models.Model):
    """One file a job's attempt left in ``/outputs``, uploaded by the agent when the attempt ended and
    kept in the artifacts storage (settings STORAGES["artifacts"]: a folder, or an S3-compatible
    bucket) under ``storage_name``."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="artifacts")
    attempt = models.PositiveIntegerField()
    path = models.CharField(max_length=1024)  # relative to /outputs, checked like a volume's paths
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    storage_name = models.CharField(max_length=1200)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["job_id", "attempt", "path"]
        constraints = [models.UniqueConstraint(fields=["job", "attempt", "path"], name="artifact_unique_path")]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt}: {self.path}"


class RegistryCredential(models.Model):
    """A project's login to one image registry, used on the node to pull the project's private
    images. The secret is stored encrypted (portal/storage/secrets.py) and never read back
    through the API, nor put in a job's environment."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="registry_credentials")
    registry = models.CharField(max_length=255)  # host[:port], as the image reference starts
    username = models.CharField(max_length=255)
    secret_encrypted = models.TextField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["project_id", "registry"]
        constraints = [models.UniqueConstraint(fields=["project", "registry"],
                                               name="registry_credential_unique_per_project")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.registry}"


class Dataset(models.Model):
    """A named, versioned, read-only input of a project (agents/datasets.py): jobs name it in
    `datasets` ("imagenet@3", or "imagenet" for its latest ready version) and see it at
    /datasets/<name>, fetched once per node into the node's cache."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.PROTECT, related_name="datasets")
    name = models.CharField(max_length=63)  # agents.datasets.NAME: lower-case, digits, '.', '_', '-'
    description = models.CharField(max_length=500, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["project_id", "name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="dataset_unique_name_per_project")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.name}"


class DatasetVersionState(models.TextChoices):
    PENDING = "pending", "Pending"  # its source is being read: files, sizes and checksums
    READY = "ready", "Ready"  # digest and size known: jobs may name it
    FAILED = "failed", "Failed"  # its source could not be read; `message` says why


class DatasetVersion(models.Model):
    """One immutable version: where it comes from and, once read, its files (path, size, sha256),
    their total size and the version's digest (agents.datasets.manifest_digest)."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    # "s3": every object below s3_prefix in s3_bucket at s3_endpoint; "http": one file at url (a tar
    # archive is unpacked on the node); "upload": one file sent through the portal, in its storage.
    source = models.CharField(max_length=8)
    url = models.CharField(max_length=2000, blank=True)
    s3_endpoint = models.CharField(max_length=500, blank=True)
    s3_bucket = models.CharField(max_length=63, blank=True)
    s3_prefix = models.CharField(max_length=1024, blank=True)
    s3_region = models.CharField(max_length=64, blank=True)
    s3_access_key = models.CharField(max_length=255, blank=True)
    s3_secret_encrypted = models.TextField(blank=True)  # portal/storage/secrets.py; write-only
    storage_name = models.CharField(max_length=1200, blank=True)  # an upload's file in the datasets storage
    archive = models.BooleanField(default=False)  # one tar file, unpacked on the node
    state = models.CharField(max_length=8, choices=DatasetVersionState.choices, default=DatasetVersionState.PENDING)
    message = models.CharField(max_length=500, blank=True)
    # When a worker began reading its source (None: not yet): one reader at a time, and a pending version
    # nobody reads (its task lost to a broker outage, its worker killed) is read again by the sweep.
    inspect_started_at = models.DateTimeField(null=True, blank=True)
    digest = models.CharField(max_length=64, blank=True, db_index=True)
    size = models.BigIntegerField(null=True, blank=True)
    files = models.JSONField(default=list, blank=True)  # [{"path", "size", "sha256"}]
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["dataset_id", "-version"]
        constraints = [models.UniqueConstraint(fields=["dataset", "version"], name="dataset_version_unique")]

    def __str__(self) -> str:
        return f"{self.dataset}@{self.version}"

    @property
    def source_text(self) -> str:
        if self.source == "s3":
            return f"s3://{self.s3_bucket}/{self.s3_prefix}"
        if self.source == "upload":
            return f"upload:{self.url}"
        return self.url
