"""REST API for interactive sessions: /api/v1/sessions/ (list, read, share)."""
from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers
from rest_framework.response import Response

from portal.core.api import StrictSerializer, TenantViewSet

from .models import Session
from .selectors import display_state, named_for_user
from .services import session_share


class SessionSerializer(serializers.ModelSerializer):
    job = serializers.IntegerField(source="job_id", read_only=True)
    state = serializers.SerializerMethodField()
    url = serializers.CharField(source="path", read_only=True,
                                help_text="Where the portal serves it: /sessions/<job>/<name>/.")
    users = serializers.SlugRelatedField(source="shared_users", slug_field="username", many=True, read_only=True,
                                         help_text="People the owner shared it with by name.")

    class Meta:
        model = Session
        fields = ["id", "job", "name", "kind", "port", "state", "share", "users", "url", "message", "created_at",
                  "running_at", "last_activity_at", "warned_at", "ended_at"]
        read_only_fields = fields

    def get_state(self, obj) -> str:
        return display_state(obj)


class SessionShareSerializer(StrictSerializer):
    share = serializers.ChoiceField(choices=["owner", "project"], required=False,
                                    help_text="owner: only you; project: every member of the job's project.")
    users = serializers.ListField(child=serializers.CharField(max_length=150), max_length=50, required=False,
                                  help_text="Usernames who may connect besides (replaces the list; [] clears it): "
                                            "members of the job's organization.")

    def validate(self, attrs):
        if not attrs:
            raise serializers.ValidationError({"share": ["Give share, users or both."]})
        return attrs


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
        named = named_for_user(self.request.user)
        if self.actor.restricted_project_id is not None:
            named = named.filter(job__project_id=self.actor.restricted_project_id)
        return Session.objects.filter(
            Q(pk__in=qs.filter(Q(job__user=self.request.user) | Q(share="project")).values("pk"))
            | Q(pk__in=named.values("pk"))).select_related("job").prefetch_related("shared_users") \
            .order_by("-job_id", "name")

    @extend_schema(request=SessionShareSerializer, responses=SessionSerializer)
    def partial_update(self, request, pk=None):
        data = SessionShareSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        session = session_share(actor=self.actor, session=self.get_object(), share=data.validated_data.get("share"),
                                users=data.validated_data.get("users"))
        return Response(SessionSerializer(session).data)
