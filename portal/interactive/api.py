"""REST API for interactive sessions: /api/v1/sessions/ (list, read, share)."""
from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers
from rest_framework.response import Response

from portal.core.api import StrictSerializer, TenantViewSet

from .models import Session
from .selectors import display_state
from .services import session_share


class SessionSerializer(serializers.ModelSerializer):
    job = serializers.IntegerField(source="job_id", read_only=True)
    state = serializers.SerializerMethodField()
    url = serializers.CharField(source="path", read_only=True,
                                help_text="Where the portal serves it: /sessions/<job>/<name>/.")

    class Meta:
        model = Session
        fields = ["id", "job", "name", "kind", "port", "state", "share", "url", "message", "created_at",
                  "running_at", "last_activity_at", "warned_at", "ended_at"]
        read_only_fields = fields

    def get_state(self, obj) -> str:
        return display_state(obj)


class SessionShareSerializer(StrictSerializer):
    share = serializers.ChoiceField(choices=["owner", "project"],
                                    help_text="owner: only you; project: every member of the job's project.")


class SessionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """Sessions you may connect to: your jobs' published ports, and those shared with your projects.
    Connect in a browser at `url`; `gpuctl shell` and `gpuctl port-forward` use them too."""

    scoped_model = Session
    serializer_class = SessionSerializer
    filterset_fields = ["job", "state", "kind"]
    scope_for_action = {"partial_update": "submit"}
    http_method_names = ["get", "patch", "head", "options"]

    def get_queryset(self):
        qs = super().get_queryset().select_related("job")
        if getattr(self, "swagger_fake_view", False):
            return qs
        return qs.filter(Q(job__user=self.request.user) | Q(share="project")).order_by("-job_id", "name")

    @extend_schema(request=SessionShareSerializer, responses=SessionSerializer)
    def partial_update(self, request, pk=None):
        data = SessionShareSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        session = session_share(actor=self.actor, session=self.get_object(), share=data.validated_data["share"])
        return Response(SessionSerializer(session).data)
