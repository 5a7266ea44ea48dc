from django.db.models import Prefetch
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from portal.core.api import StrictCharField, StrictModelSerializer, StrictSerializer, TenantViewSet
from portal.core.numbers import parse_int
from portal.jobs.models import Job
from portal.tenancy.api import ProjectChoiceSerializer
from portal.tenancy.models import slug_validator

from .artifacts import artifact_response, artifacts_of, retention_days
from .artifacts import expires_at as artifact_expires_at
from .files import download_response
from .datasets import dataset_create, dataset_delete, dataset_upload, dataset_version_add
from .models import Artifact, Dataset, DatasetVersion, RegistryCredential, Volume
from .selectors import volume_file_open, volume_list_dir
from .services import (registry_credential_delete, registry_credential_set, volume_create, volume_delete,
                       volume_file_put)

PATH_PARAM = OpenApiParameter("path", str, OpenApiParameter.QUERY, required=False,
                              description="A path relative to the volume ('' is its top); no '..', not absolute.")


class VolumeSerializer(ProjectChoiceSerializer):
    name = serializers.CharField(max_length=50, validators=[slug_validator])
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    mount_path = serializers.SerializerMethodField(help_text="Where the project's jobs see it.")

    class Meta:
        model = Volume
        fields = ["id", "project", "name", "quota_mb", "mount_path", "created_by", "created_at"]
        read_only_fields = ["id", "created_by", "created_at"]
        validators = []  # the service names the field of a taken name (not DRF's non_field_errors)

    def get_mount_path(self, volume) -> str:
        return f"/data/{volume.name}"


REGISTRY_HOST = r"^[a-z0-9](?:[a-z0-9.-]{0,200}[a-z0-9])?(?::[0-9]{1,5})?$"


class RegistryCredentialSerializer(ProjectChoiceSerializer):
    registry = serializers.RegexField(REGISTRY_HOST, max_length=255, help_text=(
        "The registry's host[:port] as image references start, e.g. registry.example.org:5000."))
    username = StrictCharField(max_length=255)
    secret = StrictCharField(max_length=4096, write_only=True, trim_whitespace=False,
                             help_text="Password or token. Write-only: never returned, never in a job's environment.")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = RegistryCredential
        fields = ["id", "project", "registry", "username", "secret", "created_by", "created_at"]
        read_only_fields = ["id", "created_by", "created_at"]
        validators = []  # a second login to the same registry replaces the first


class PathQuerySerializer(StrictSerializer):
    path = StrictCharField(max_length=1024, required=False, allow_blank=True, default="", trim_whitespace=False)


class EntrySerializer(serializers.Serializer):
    name = serializers.CharField()
    type = serializers.ChoiceField(choices=["dir", "file", "symlink", "other"])
    size = serializers.IntegerField(allow_null=True)
    modified = serializers.IntegerField(help_text="Unix time.")


class ListingSerializer(serializers.Serializer):
    path = serializers.CharField()
    entries = EntrySerializer(many=True)
    truncated = serializers.BooleanField()


class UploadedSerializer(serializers.Serializer):
    path = serializers.CharField()
    size = serializers.IntegerField()


class VolumeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """A project's volumes: everyone in it reads and downloads, members upload, owners and admins
    create and delete. Jobs name them in `volumes` and see them at /data/<name>."""

    scoped_model = Volume
    serializer_class = VolumeSerializer
    filterset_fields = {"project__slug": ["exact"]}
    scope_for_action = {"upload": "submit"}

    def get_queryset(self):
        return super().get_queryset().select_related("project__organization", "created_by")

    def _path(self, request) -> str:
        query = PathQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        return query.validated_data["path"]

    def create(self, request):
        data = VolumeSerializer(data=request.data, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        v = data.validated_data
        volume = volume_create(actor=self.actor, project=v["project"], name=v["name"], quota_mb=v.get("quota_mb"))
        return Response(VolumeSerializer(volume).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk=None):
        volume_delete(actor=self.actor, volume=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(parameters=[PATH_PARAM], responses=ListingSerializer)
    @action(detail=True, methods=["get"])
    def files(self, request, pk=None):
        """List one folder of the volume."""
        return Response(volume_list_dir(volume=self.get_object(), path=self._path(request)))

    @extend_schema(parameters=[PATH_PARAM], request={"application/octet-stream": OpenApiTypes.BINARY},
                   responses={201: UploadedSerializer})
    @files.mapping.put
    def upload(self, request, pk=None):
        """Write the request body as the file at `path` (replacing a file there). 413 over the upload
        limit or the volume's quota."""
        volume = self.get_object()
        length = parse_int(request.META.get("CONTENT_LENGTH"))
        stream = request._request  # the raw body, read in chunks: never parsed nor held in memory
        return Response(volume_file_put(actor=self.actor, volume=volume, path=self._path(request), stream=stream,
                                        length=length), status=status.HTTP_201_CREATED)

    @extend_schema(parameters=[PATH_PARAM], responses={(200, "application/octet-stream"): OpenApiTypes.BINARY})
    @action(detail=True, methods=["get"])
    def download(self, request, pk=None):
        """The file at `path`, as an attachment."""
        return download_response(*volume_file_open(volume=self.get_object(), path=self._path(request)))


class ArtifactSerializer(serializers.ModelSerializer):
    class Meta:
        model = Artifact
        fields = ["id", "attempt", "path", "size", "sha256", "created_at", "expires_at"]

    expires_at = serializers.SerializerMethodField(
        help_text="When the artifact is deleted: its upload plus its project's artifact retention (quota "
                  "artifact_retention_days, else ARTIFACTS_RETENTION_DAYS); null: kept forever.")

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_expires_at(self, artifact):
        value = artifact_expires_at(artifact, self.context["retention_days"])
        return serializers.DateTimeField().to_representation(value) if value else None


class ArtifactListQuerySerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)


class JobArtifactViewSet(TenantViewSet):
    """What a job's attempts left in /outputs, uploaded by the agent when each ended. Whoever may see
    the job may list and download them; for anyone else the job does not exist (404)."""

    scoped_model = Job  # the job scopes its artifacts

    lookup_value_regex = "[0-9]+"

    def _job(self):
        return get_object_or_404(self.get_queryset(), pk=parse_int(self.kwargs["job_pk"]))

    @extend_schema(parameters=[OpenApiParameter("attempt", int, OpenApiParameter.QUERY, required=False,
                                                description="Only this attempt's artifacts.")],
                   responses=ArtifactSerializer(many=True))
    def list(self, request, job_pk=None):
        """The job's artifacts, by attempt then path."""
        query = ArtifactListQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        job = self._job()
        return Response(ArtifactSerializer(artifacts_of(job, query.validated_data.get("attempt")), many=True,
                                           context={"retention_days": retention_days(job.project)}).data)

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY,
                              302: OpenApiResponse(description="S3-compatible storage: a presigned URL of the file "
                                                               "in Location, valid ARTIFACTS_PRESIGN_S seconds.")})
    def retrieve(self, request, job_pk=None, pk=None):
        """The artifact's file, as an attachment (its SHA-256 in X-Checksum-Sha256). With S3-compatible
        storage the answer is a redirect to a short-lived presigned URL the storage serves the bytes at."""
        return artifact_response(get_object_or_404(artifacts_of(self._job()), pk=parse_int(pk)))


class RegistryCredentialViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """Logins to private image registries, per project: owners and admins set and delete them,
    everyone in the project sees which registries have one (never the secret). Nodes pull the
    project's images with them."""

    scoped_model = RegistryCredential
    serializer_class = RegistryCredentialSerializer
    filterset_fields = {"project__slug": ["exact"]}

    def get_queryset(self):
        return super().get_queryset().select_related("project", "created_by")

    def create(self, request):
        data = RegistryCredentialSerializer(data=request.data, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        cred = registry_credential_set(actor=self.actor, **data.validated_data)
        return Response(RegistryCredentialSerializer(cred).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk=None):
        registry_credential_delete(actor=self.actor, credential=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class DatasetVersionSerializer(serializers.ModelSerializer):
    source = serializers.CharField(read_only=True, help_text="s3, http or upload.")
    location = serializers.CharField(source="source_text", read_only=True,
                                     help_text="s3://bucket/prefix, the URL, or upload:<file name>.")
    file_count = serializers.SerializerMethodField()
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = DatasetVersion
        fields = ["version", "state", "message", "source", "location", "archive", "digest", "size", "file_count",
                  "created_by", "created_at"]
        read_only_fields = fields

    def get_file_count(self, version) -> int:
        return len(version.files or [])


class DatasetSourceSerializer(serializers.Serializer):
    """Where a version comes from (checked by portal/storage/datasets.check_source)."""

    kind = serializers.ChoiceField(choices=["s3", "http"])
    url = serializers.CharField(required=False, help_text="http: the file's http(s) URL (a tar archive is unpacked).")
    bucket = serializers.CharField(required=False, help_text="s3: the bucket.")
    prefix = serializers.CharField(required=False, help_text="s3: every object below this key prefix.")
    endpoint_url = serializers.CharField(required=False, help_text="s3: the S3-compatible endpoint (default AWS).")
    region = serializers.CharField(required=False)
    access_key = serializers.CharField(required=False)
    secret_key = serializers.CharField(required=False, write_only=True, help_text="Write-only, stored encrypted.")


@extend_schema_field(DatasetSourceSerializer)
class SourceField(serializers.JSONField):
    """A source object, checked as a whole by the service (field errors name source.<key>)."""


class DatasetSerializer(ProjectChoiceSerializer):
    name = serializers.CharField(max_length=63, help_text="Lower-case letters, digits, '.', '_' and '-'.")
    description = StrictCharField(max_length=500, required=False, allow_blank=True, default="")
    source = SourceField(required=False, write_only=True, help_text=(
        "Version 1's source: {kind: http, url} or {kind: s3, bucket, prefix, endpoint_url, region, access_key, "
        "secret_key}. Without one, add versions later (POST .../versions/ or PUT .../upload/)."))
    latest = serializers.SerializerMethodField(help_text="The newest ready version's number, which 'name' means in "
                                                         "a job spec (null: none ready).")
    mount_path = serializers.SerializerMethodField(help_text="Where jobs naming it see it.")
    versions = serializers.SerializerMethodField()
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Dataset
        fields = ["id", "project", "name", "description", "source", "latest", "mount_path", "versions",
                  "created_by", "created_at"]
        read_only_fields = ["id", "created_by", "created_at"]
        validators = []  # the service names the field of a taken name

    def get_latest(self, dataset) -> int | None:
        return next((v.version for v in dataset.versions.all() if v.state == "ready"), None)

    def get_mount_path(self, dataset) -> str:
        return f"/datasets/{dataset.name}"

    @extend_schema_field(DatasetVersionSerializer(many=True))
    def get_versions(self, dataset):
        return DatasetVersionSerializer(dataset.versions.all(), many=True).data


class DatasetVersionCreateSerializer(StrictSerializer):
    source = SourceField(help_text="As for a new dataset's source.")


class FilenameQuerySerializer(StrictSerializer):
    filename = StrictCharField(max_length=255, trim_whitespace=False,
                               help_text="The file's name on the node (a .tar, .tar.gz, .tgz... is unpacked).")


class DatasetViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """A project's datasets: named, versioned, read-only inputs. Members create them and add versions
    (each immutable; its digest and size once its source is read), owners and admins delete them,
    everyone in the project reads them. Jobs name them in `datasets` and read them at /datasets/<name>."""

    scoped_model = Dataset
    serializer_class = DatasetSerializer
    filterset_fields = {"project__slug": ["exact"]}
    scope_for_action = {"create": "submit", "versions": "submit", "upload": "submit"}

    def get_queryset(self):
        return super().get_queryset().select_related("project", "created_by").prefetch_related(
            Prefetch("versions", queryset=DatasetVersion.objects.select_related("created_by").order_by("-version")))

    def create(self, request):
        data = DatasetSerializer(data=request.data, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        v = data.validated_data
        dataset = dataset_create(actor=self.actor, project=v["project"], name=v["name"],
                                 description=v.get("description", ""), source=v.get("source"))
        return Response(DatasetSerializer(self.get_queryset().get(pk=dataset.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk=None):
        dataset_delete(actor=self.actor, dataset=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=DatasetVersionCreateSerializer, responses={201: DatasetVersionSerializer})
    @action(detail=True, methods=["post"])
    def versions(self, request, pk=None):
        """Add the next version from a bucket or a URL: pending until the portal has read its files."""
        dataset = self.get_object()
        data = DatasetVersionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        version = dataset_version_add(actor=self.actor, dataset=dataset, source=data.validated_data["source"])
        return Response(DatasetVersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @extend_schema(parameters=[OpenApiParameter("filename", str, OpenApiParameter.QUERY, required=True)],
                   request={"application/octet-stream": OpenApiTypes.BINARY},
                   responses={201: DatasetVersionSerializer})
    @action(detail=True, methods=["put"])
    def upload(self, request, pk=None):
        """Add the next version from the request body (one file; 413 over DATASET_UPLOAD_MAX_MB): ready at once."""
        dataset = self.get_object()
        query = FilenameQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        length = parse_int(request.META.get("CONTENT_LENGTH"))
        version = dataset_upload(actor=self.actor, dataset=dataset, filename=query.validated_data["filename"],
                                 stream=request._request, length=length)
        return Response(DatasetVersionSerializer(version).data, status=status.HTTP_201_CREATED)
