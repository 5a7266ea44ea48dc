from django.conf import settings
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.core.api import ActorMixin, StrictModelSerializer, StrictSerializer, TenantViewSet
from portal.tenancy.models import Membership, Project

from .models import ApiToken, NotificationPreference, Scope
from .services import notification_preferences_update, token_issue, token_revoke


class TokenSerializer(serializers.ModelSerializer):
    project = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    active = serializers.BooleanField(source="is_active", read_only=True)
    parent = serializers.PrimaryKeyRelatedField(read_only=True, help_text=(
        "The token this one was created with (null when created in a browser session): it never outlives "
        "it and is revoked with it."))

    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "scopes", "project", "parent", "created_at", "expires_at", "last_used_at",
                  "revoked_at", "active"]
        read_only_fields = fields


class TokenCreatedSerializer(TokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret. Shown only in this response.")

    class Meta(TokenSerializer.Meta):
        fields = TokenSerializer.Meta.fields + ["token"]
        read_only_fields = fields


class TokenCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices), max_length=3,
                                   default=lambda: [Scope.READ, Scope.SUBMIT])
    project = serializers.CharField(max_length=50, required=False, allow_null=True, default=None)
    expires_days = serializers.IntegerField(min_value=1, max_value=3650, required=False)


class TokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """Your personal API tokens. The secret is returned once, by create."""

    scoped_model = ApiToken
    serializer_class = TokenSerializer
    filterset_fields = ["project"]

    def get_queryset(self):
        return super().get_queryset().select_related("project")

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request):
        data = TokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = None
        slug = data.validated_data["project"]
        if slug:
            project = Project.objects.for_user(request.user, "view", project_id=self.actor.restricted_project_id) \
                .filter(slug=slug).first()
            if project is None:
                raise serializers.ValidationError({"project": [f"No project named {slug!r}."]})
        token, secret = token_issue(
            actor=self.actor, user=request.user, name=data.validated_data["name"],
            scopes=data.validated_data["scopes"], project=project,
            expires_days=data.validated_data.get("expires_days"),
        )
        token.token = secret
        return Response(TokenCreatedSerializer(token).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None}, description="Revoke the token. It stays listed, inactive.")
    def destroy(self, request, pk=None):
        token_revoke(actor=self.actor, token=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class MeView(ActorMixin, APIView):
    """Who the caller is, their project roles, and the token in use."""

    @extend_schema(responses=inline_serializer("Me", fields={
        "username": serializers.CharField(), "email": serializers.CharField(),
        "is_staff": serializers.BooleanField(), "memberships": serializers.ListField(),
        "token": serializers.DictField(allow_null=True),
    }))
    def get(self, request):
        actor = self.actor
        memberships = Membership.objects.for_user(request.user, "view", project_id=actor.restricted_project_id)
        memberships = memberships.filter(user=request.user).select_related("project__organization")
        token = actor.token
        return Response({
            "username": request.user.get_username(),
            "email": request.user.email,
            "is_staff": request.user.is_staff,
            "memberships": [
                {"project": m.project.slug, "organization": m.project.organization.slug, "role": m.role}
                for m in memberships
            ],
            "token": None if token is None else {
                "prefix": token.prefix, "scopes": token.scopes,
                "project": token.project.slug if token.project else None,
                "expires_at": token.expires_at,
            },
            "token_max_expiry_days": settings.TOKEN_MAX_EXPIRY_DAYS,
        })


class NotificationPreferenceSerializer(StrictModelSerializer):
    class Meta:
        model = NotificationPreference
        fields = ["job_succeeded", "job_failed", "job_preempted", "job_idle"]
        extra_kwargs = {
            "job_succeeded": {"help_text": "Email when a job of yours succeeds (default off)."},
            "job_failed": {"help_text": "Email when one fails, times out, runs out of memory or loses its node."},
            "job_preempted": {"help_text": "Email when one is preempted or requeued off a faulty GPU or node."},
            "job_idle": {"help_text": "Email when one is flagged idle (its GPUs unused), and when its interactive "
                                      "sessions are warned before an idle stop."},
        }


class NotificationPreferenceView(ActorMixin, APIView):
    """Your email preferences for job events. Array jobs mail once, when the array ends."""

    @extend_schema(responses=NotificationPreferenceSerializer)
    def get(self, request):
        prefs = NotificationPreference.objects.filter(user=request.user).first() \
            or NotificationPreference(user=request.user)
        return Response(NotificationPreferenceSerializer(prefs).data)

    @extend_schema(request=NotificationPreferenceSerializer, responses=NotificationPreferenceSerializer)
    def patch(self, request):
        data = NotificationPreferenceSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        prefs = notification_preferences_update(actor=self.actor, user=request.user, **data.validated_data)
        return Response(NotificationPreferenceSerializer(prefs).data)
