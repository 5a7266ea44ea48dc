"""Private images on the node (docs/storage.md, "Private images"): the project's registry login for
the image of an attempt the asking node is starting, and the launch's progress as the job's reason.

The login goes to the node only here, in the answer to its own node token, only while that node
holds the attempt assigned or starting (a running attempt never pulls): never in the launch
message on the broker, the launch spec or the job's environment. Composed here, above jobs and
storage, since it reads both."""
import logging

from cryptography.fernet import InvalidToken
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response

from agents import protocol
from portal.core.api import StrictCharField, StrictSerializer, validated
from portal.jobs.models import JobState
from portal.jobs.reports import held_job, job_progress
from portal.nodes.agent_api import MAX_ATTEMPT, AgentView, speaks
from portal.storage import secrets
from portal.storage.models import RegistryCredential

log = logging.getLogger(__name__)


@speaks(protocol.REGISTRY_AUTH)
class RegistryAuthSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0, max_value=MAX_ATTEMPT)


class RegistryAuthView(AgentView):
    @extend_schema(request=RegistryAuthSerializer, responses=inline_serializer("RegistryAuth", {
        "registry": serializers.CharField(help_text="The registry of the job's image (host[:port]; docker.io)."),
        "username": serializers.CharField(help_text="The project's login there; \"\" when it has none."),
        "password": serializers.CharField(help_text="Its secret, for this pull only; \"\" when none."),
        "problem": serializers.CharField(required=False, help_text="Why the stored login cannot be used.")}))
    def post(self, request, job_id):
        answer = job_registry_auth(node=self.node, job_id=job_id, **validated(RegistryAuthSerializer, request.data))
        return Response(answer, headers={"Cache-Control": "no-store"})


def job_registry_auth(*, node, job_id, attempt: int) -> dict:
    """The login of the job's project to the registry its image names, for the node starting it."""
    job = held_job(node=node, job_id=job_id, attempt=attempt, states={JobState.ASSIGNED, JobState.STARTING})
    registry = protocol.image_registry(job.image)
    names = protocol.DOCKER_HUB_ALIASES if registry == protocol.DOCKER_HUB else (registry,)
    cred = RegistryCredential.objects.filter(project_id=job.project_id, registry__in=names).order_by("registry").first()
    if cred is None:
        return {"registry": registry, "username": "", "password": ""}
    try:
        password = secrets.decrypt(cred.secret_encrypted)
    except InvalidToken:
        return {"registry": registry, "username": cred.username, "password": "",
                "problem": f"the project's stored login to {registry} cannot be decrypted (the portal's SECRET_KEY "
                           f"changed): set it again"}
    log.info("node %s: the login %r of project %s to %s handed over for job %s attempt %s", node.name, cred.username,
             job.project_id, registry, job.pk, attempt)
    return {"registry": registry, "username": cred.username, "password": password}


@speaks(protocol.PROGRESS)
class ProgressSerializer(StrictSerializer):
    attempt = serializers.IntegerField(min_value=0, max_value=MAX_ATTEMPT)
    stage = serializers.ChoiceField(choices=protocol.PROGRESS_STAGES)
    message = StrictCharField(max_length=protocol.PROGRESS_MESSAGE_MAX)


class ProgressView(AgentView):
    @extend_schema(request=ProgressSerializer, responses=inline_serializer("ProgressApplied", {
        "result": serializers.CharField()}))
    def post(self, request, job_id):
        data = validated(ProgressSerializer, request.data)
        return Response({"result": job_progress(node=self.node, job_id=job_id, **data)})
