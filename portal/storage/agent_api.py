"""The agent API's artifact upload: PUT /api/agent/v1/jobs/<id>/artifacts?attempt=&path= with the file as
the body (portal/storage/artifacts.py). Node tokens only, as the rest of the agent API."""
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response

from portal.core.api import StrictCharField, StrictSerializer
from portal.core.numbers import parse_int
from portal.nodes.agent_api import MAX_ATTEMPT, AgentView

from .artifacts import artifact_put


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


class DatasetFileView(AgentView):
    """An uploaded dataset version's file, for a node that holds a job naming it (else 404): the
    launch spec gives it as "agent:datasets/<digest>/file" (agents/datasets.py)."""

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY})
    def get(self, request, digest):
        from .datasets import upload_for_node
        from .files import download_response

        return download_response(*upload_for_node(node=self.node, digest=digest))
