from django.contrib.auth import get_user_model
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import OuterRef, Subquery
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from portal.core.api import StrictModelSerializer, StrictSerializer, TenantViewSet
from portal.core.context import actor_from_request
from portal.core.numbers import GPUCountField

from .models import Membership, Organization, Project, Quota, Role, slug_validator
from .services import (
    membership_add,
    membership_change_role,
    membership_remove,
    organization_create,
    project_create,
    project_update,
    quota_update,
)

User = get_user_model()

image_pattern_validator = RegexValidator(
    r"^[A-Za-z0-9._/:@*?\[\]-]+$",
    "Use an image reference or a pattern of one: letters, digits, '._/:@-' and the wildcards '*?[]'.")


class ProjectChoiceSerializer(StrictModelSerializer):
    """A row of one project, named by slug: the choices are the projects the caller sees."""

    project = serializers.SlugRelatedField(slug_field="slug", queryset=Project.objects.none())

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        request = self.context.get("request")
        if request is not None and request.user.is_authenticated:
            # The choices honour a token's project restriction: other projects do not exist for it.
            self.fields["project"].queryset = Project.objects.for_user(
                request.user, "view", project_id=actor_from_request(request).restricted_project_id)


class OrganizationSerializer(StrictModelSerializer):
    class Meta:
        model = Organization
        fields = ["slug", "name", "max_gpus", "created_at"]
        read_only_fields = ["created_at"]
        extra_kwargs = {"slug": {"validators": [slug_validator]}}


class OrganizationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """Organizations you belong to (staff: all). Staff create them."""

    scoped_model = Organization
    serializer_class = OrganizationSerializer
    lookup_field = "slug"
    account_wide_actions = frozenset({"create"})  # a new organization lies outside a token's one project

    def create(self, request):
        data = OrganizationSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        org = organization_create(actor=self.actor, **data.validated_data)
        return Response(OrganizationSerializer(org).data, status=status.HTTP_201_CREATED)


class QuotaSerializer(StrictModelSerializer):
    # GPUs and GPU-hours read as JSON numbers (4, 0.5), not decimal strings.
    serializer_field_mapping = {**StrictModelSerializer.serializer_field_mapping,
                                models.DecimalField: GPUCountField}
    allowed_gpu_types = serializers.ListField(child=serializers.CharField(max_length=64), max_length=64,
                                              required=False)
    allowed_images = serializers.ListField(
        child=serializers.CharField(max_length=255, validators=[image_pattern_validator]), max_length=256,
        required=False, help_text="Images jobs may use: references or shell-style patterns such as "
                                  "'registry.example.org/team/*' (`*` also matches '/'). Empty: any image.")

    class Meta:
        model = Quota
        fields = ["guaranteed_gpus", "max_gpus", "max_running_jobs", "max_time_limit_s", "gpu_hours_budget",
                  "budget_hard_stop", "allowed_gpu_types", "allowed_images", "network_allowed", "idle_auto_cancel",
                  "artifact_retention_days"]
        extra_kwargs = {"artifact_retention_days": {"max_value": 36500, "help_text": (
            "Days the artifacts of its jobs are kept after upload; null: the site default "
            "(ARTIFACTS_RETENTION_DAYS); 0: forever.")}}


class ProjectSerializer(StrictModelSerializer):
    organization = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    quota = QuotaSerializer(read_only=True)
    role = serializers.CharField(read_only=True, allow_null=True,
                                 help_text="Your role in the project (null for staff who are not members).")

    class Meta:
        model = Project
        fields = ["slug", "name", "description", "organization", "role", "quota", "created_at"]
        read_only_fields = ["slug", "organization", "role", "quota", "created_at"]


class ProjectCreateSerializer(StrictSerializer):
    organization = serializers.SlugRelatedField(slug_field="slug", queryset=Organization.objects.all())
    slug = serializers.CharField(max_length=50, validators=[slug_validator])
    name = serializers.CharField(max_length=200)
    description = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")
    owner = serializers.SlugRelatedField(slug_field="username", queryset=User.objects.filter(is_active=True),
                                         required=False, allow_null=True, default=None)
    quota = QuotaSerializer(required=False)


class MembershipSerializer(StrictSerializer):
    username = serializers.CharField(max_length=150, source="user.username")
    role = serializers.ChoiceField(choices=Role.choices)
    created_at = serializers.DateTimeField(read_only=True)


class MembershipRoleSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=Role.choices)


class ProjectViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """Projects you may see, with your role and the quota. Staff create projects and set quotas;
    owners and admins edit name and description."""

    scoped_model = Project
    serializer_class = ProjectSerializer
    lookup_field = "slug"
    account_wide_actions = frozenset({"create"})  # a new project lies outside a token's one project
    filterset_fields = {"organization__slug": ["exact"]}

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Project.objects.none()
        my_role = Membership.objects.filter(project=OuterRef("pk"), user=self.request.user).values("role")[:1]
        return super().get_queryset().select_related("organization", "quota").annotate(role=Subquery(my_role))

    @extend_schema(request=ProjectCreateSerializer, responses={201: ProjectSerializer})
    def create(self, request):
        data = ProjectCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project = project_create(actor=self.actor, **data.validated_data)
        return Response(ProjectSerializer(self.get_queryset().get(pk=project.pk)).data,
                        status=status.HTTP_201_CREATED)

    def partial_update(self, request, slug=None):
        project = self.get_object()
        data = ProjectSerializer(project, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        project_update(actor=self.actor, project=project, **data.validated_data)
        return Response(ProjectSerializer(self.get_queryset().get(pk=project.pk)).data)

    @extend_schema(methods=["GET"], responses=QuotaSerializer)
    @extend_schema(methods=["PATCH"], request=QuotaSerializer, responses=QuotaSerializer)
    @action(detail=True, methods=["get", "patch"])
    def quota(self, request, slug=None):
        """The project's quota. Only staff change it."""
        project = self.get_object()
        if request.method == "GET":
            return Response(QuotaSerializer(project.quota).data)
        data = QuotaSerializer(project.quota, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        return Response(QuotaSerializer(quota_update(actor=self.actor, project=project, **data.validated_data)).data)


class MemberViewSet(TenantViewSet):
    """Members of one project. Everyone in the project sees them; owners and admins manage them."""

    scoped_model = Membership
    serializer_class = MembershipSerializer
    lookup_field = "user__username"
    lookup_url_kwarg = "username"
    lookup_value_regex = r"[\w.@+-]+"
    pagination_class = None

    def get_project(self) -> Project:
        if not hasattr(self, "_project"):
            visible = Project.objects.for_user(self.request.user, "view", project_id=self.actor.restricted_project_id)
            self._project = get_object_or_404(visible, slug=self.kwargs["project_slug"])
        return self._project

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Membership.objects.none()
        return super().get_queryset().filter(project=self.get_project()).select_related("user", "project")

    def list(self, request, project_slug=None):
        return Response(MembershipSerializer(self.get_queryset(), many=True).data)

    def retrieve(self, request, project_slug=None, username=None):
        return Response(MembershipSerializer(self.get_object()).data)

    def create(self, request, project_slug=None):
        data = MembershipSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = membership_add(actor=self.actor, project=self.get_project(),
                                    username=data.validated_data["user"]["username"],
                                    role=data.validated_data["role"])
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=MembershipRoleSerializer)
    def partial_update(self, request, project_slug=None, username=None):
        membership = self.get_object()
        data = MembershipRoleSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = membership_change_role(actor=self.actor, membership=membership, role=data.validated_data["role"])
        return Response(MembershipSerializer(membership).data)

    def destroy(self, request, project_slug=None, username=None):
        membership_remove(actor=self.actor, membership=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)
