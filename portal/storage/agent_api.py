"""The agent API's artifact upload: PUT /api/agent/v1/jobs/<id>/artifacts?attempt=&path= with the file as
the body (portal/storage/artifacts.py), or straight to an S3-compatible storage through POST
.../artifacts/uploads and .../artifacts/confirm (portal/storage/artifact_direct.py). Node tokens only,
as the rest of the agent API."""
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response

from portal.core.api import StrictCharField, StrictSerializer
from portal.core.numbers import parse_int
from portal.nodes.agent_api import MAX_ATTEMPT, AgentView

from .artifact_direct import upload_confirm, upload_issue
from .artifacts import artifact_put
from .datasets import upload_for_node
from .files import download_response


class ArtifactQuerySerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0, max_value=MAX_ATTEMPT)
    path = StrictCharField(max_length=1024, trim_whitespace=False)


class ArtifactUploadView(AgentView):
    @extend_schema(parameters=[OpenApiParameter("attempt", int, OpenApiParameter.QUERY, required=True),
                               OpenApiParameter("path", str, OpenApiParameter.QUERY, required=True)],
                   request={"application/octet-stream": OpenApiTypes.BINARY},
                   responses={201: inline_serializer("ArtifactStored", {
                       "path": serializers.CharField(), "size": serializers.IntegerField(),
                       "sha256": serializers.CharField()})})
    def put(self, request, job_id):
        query = ArtifactQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        length = parse_int(request.META.get("CONTENT_LENGTH"))
        stream = request._request  # the raw body, read in chunks: never parsed nor held in memory
        return Response(artifact_put(node=self.node, job_id=job_id, stream=stream, length=length,
                                     **query.validated_data), status=status.HTTP_201_CREATED)


class ArtifactUploadRequestSerializer(ArtifactQuerySerializer):
    size = serializers.IntegerField(min_value=0)


class ArtifactConfirmSerializer(ArtifactUploadRequestSerializer):
    sha256 = StrictCharField(min_length=64, max_length=64)


class ArtifactDirectUploadView(AgentView):
    """A presigned PUT URL of the storage for one file (agent 1.6+ with an S3-compatible storage), or
    {"relay": true}: upload it through PUT .../artifacts instead (portal/storage/artifact_direct.py)."""

    @extend_schema(request=ArtifactUploadRequestSerializer, responses={200: inline_serializer("ArtifactUploadUrl", {
        "relay": serializers.BooleanField(), "path": serializers.CharField(required=False),
        "size": serializers.IntegerField(required=False), "url": serializers.CharField(required=False),
        "method": serializers.CharField(required=False), "expires_in": serializers.IntegerField(required=False)})})
    def post(self, request, job_id):
        body = ArtifactUploadRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return Response(upload_issue(node=self.node, job_id=job_id, **body.validated_data))


class ArtifactConfirmView(AgentView):
    """Record a file the node PUT at its presigned URL: refused (400) when the storage has no object
    there or one of another size."""

    @extend_schema(request=ArtifactConfirmSerializer, responses={201: inline_serializer("ArtifactConfirmed", {
        "path": serializers.CharField(), "size": serializers.IntegerField(), "sha256": serializers.CharField()})})
    def post(self, request, job_id):
        body = ArtifactConfirmSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return Response(upload_confirm(node=self.node, job_id=job_id, **body.validated_data),
                        status=status.HTTP_201_CREATED)


class DatasetFileView(AgentView):
    """An uploaded dataset version's file, for a node that holds a job naming it (else 404): the
    launch spec gives it as "agent:datasets/<digest>/file" (agents/datasets.py)."""

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY})
    def get(self, request, digest):
        return download_response(*upload_for_node(node=self.node, digest=digest))
