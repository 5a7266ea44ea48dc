from decimal import Decimal

from django.conf import settings
from django.contrib.contenttypes.models import ContentType
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from guardian.models import GroupObjectPermissionBase, UserObjectPermissionBase

slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$",
    "Use 1-50 lowercase letters, digits and hyphens, starting and ending with a letter or digit.",
)


# The single tenancy choke point: `Model.objects.for_user(user, action)`. Every tenant-owned model's
# manager is built from TenantQuerySet with `project_path` saying how to reach its Project. Visibility
# comes from django-guardian object permissions on Project, which the membership services keep in
# step with roles. Staff see (and manage) everything but submit only where they are members.
# It lives beside Project, whose permissions it reads; the apps above build their managers from it.

ACTION_PERMS = {
    "view": "view_project",
    "submit": "submit_job",
    "manage": "manage_project",
}


def allowed_project_ids(user, action: str):
    """A subquery of Project ids on which `user` holds the permission for `action`.

    What guardian's get_objects_for_user(user, perm, klass=Project, use_groups=False,
    with_superuser=False, accept_global_perms=False) selects, written directly against the
    direct-FK permission table: building guardian's query cost more CPU than a submit's insert,
    and every request of tenant data builds one (tests/tenancy/test_allowed_projects.py holds
    the two to the same answer)."""
    if action not in ACTION_PERMS:
        raise ValueError(f"unknown tenant action {action!r}")
    if user is None or not user.is_authenticated:
        return Project.objects.none().values("pk")
    granted = ProjectUserObjectPermission.objects.filter(
        user=user, permission__codename=ACTION_PERMS[action],
        permission__content_type=ContentType.objects.get_for_model(Project)).values("content_object_id")
    return Project.objects.filter(pk__in=granted).values("pk")


def staff_bypass(user, action: str) -> bool:
    return bool(user.is_staff) and action in ("view", "manage")


class TenantQuerySet(models.QuerySet):
    #: lookup path from this model to its Project ("" when the model is Project)
    project_path = "project"

    def _project_id_lookup(self) -> str:
        return f"{self.project_path}__pk" if self.project_path else "pk"

    def for_user(self, user, action: str = "view", *, project_id: int | None = None):
        if user is None or not user.is_authenticated or not user.is_active:
            return self.none()
        qs = self
        lookup = self._project_id_lookup()
        if not staff_bypass(user, action):
            qs = qs.filter(**{f"{lookup}__in": allowed_project_ids(user, action)})
        if project_id is not None:
            qs = qs.filter(**{lookup: project_id})
        return qs


class OrganizationQuerySet(models.QuerySet):
    def for_user(self, user, action: str = "view", *, project_id: int | None = None):
        """An organization is visible to whoever may see one of its projects."""
        if user is None or not user.is_authenticated or not user.is_active:
            return self.none()
        qs = self
        if not staff_bypass(user, action):
            qs = qs.filter(pk__in=Project.objects.filter(pk__in=allowed_project_ids(user, action)).values("organization"))
        if project_id is not None:
            qs = qs.filter(pk__in=Project.objects.filter(pk=project_id).values("organization"))
        return qs


class Organization(models.Model):
    """The tenant: owns projects and pays the bills."""

    slug = models.SlugField(max_length=50, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    # Ceiling on GPUs all the organization's projects may hold at once (None: no ceiling).
    max_gpus = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OrganizationQuerySet.as_manager()

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class ProjectQuerySet(TenantQuerySet):
    project_path = ""


class Project(models.Model):
    """Where jobs run and GPU time is counted; people join it with a role."""

    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="projects")
    # Globally unique so that URLs and the CLI can name a project by slug alone.
    slug = models.SlugField(max_length=50, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True, max_length=2000)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ProjectQuerySet.as_manager()

    class Meta:
        ordering = ["slug"]
        # view_project is Django's default; these two are granted per object by role.
        permissions = [
            ("submit_job", "Submit and cancel jobs in the project"),
            ("manage_project", "Manage members, templates and settings of the project"),
        ]

    def __str__(self) -> str:
        return self.slug


class ProjectUserObjectPermission(UserObjectPermissionBase):
    """Guardian's direct-FK table for Project: fast joins instead of generic text keys."""

    content_object = models.ForeignKey(Project, on_delete=models.CASCADE)


class ProjectGroupObjectPermission(GroupObjectPermissionBase):
    content_object = models.ForeignKey(Project, on_delete=models.CASCADE)


class Role(models.TextChoices):
    # Ordered from most to least powerful; ROLE_RANK below keeps the order.
    OWNER = "owner", "Owner"  # everything, including managing owners and deleting members
    ADMIN = "admin", "Admin"  # manage members (not owners), templates; submit jobs
    MEMBER = "member", "Member"  # submit, cancel and watch jobs
    VIEWER = "viewer", "Viewer"  # read-only: jobs, logs, usage


ROLE_RANK = {Role.OWNER: 4, Role.ADMIN: 3, Role.MEMBER: 2, Role.VIEWER: 1}

# The guardian permissions each role holds on its Project.
ROLE_PERMS = {
    Role.OWNER: {"view_project", "submit_job", "manage_project"},
    Role.ADMIN: {"view_project", "submit_job", "manage_project"},
    Role.MEMBER: {"view_project", "submit_job"},
    Role.VIEWER: {"view_project"},
}
ALL_PROJECT_PERMS = {"view_project", "submit_job", "manage_project"}


class MembershipQuerySet(TenantQuerySet):
    project_path = "project"


class Membership(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = MembershipQuerySet.as_manager()

    class Meta:
        ordering = ["project__slug", "user__username"]
        constraints = [models.UniqueConstraint(fields=["project", "user"], name="membership_unique_user")]

    def __str__(self) -> str:
        return f"{self.user} {self.role} of {self.project}"


class QuotaQuerySet(TenantQuerySet):
    project_path = "project"


class Quota(models.Model):
    """A project's limits. Guaranteed GPUs are always available to it; up to max_gpus it may
    borrow idle capacity, which can be preempted back."""

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="quota")
    guaranteed_gpus = models.DecimalField(
        max_digits=7, decimal_places=2, default=Decimal("0"), validators=[MinValueValidator(0)]
    )
    max_gpus = models.DecimalField(max_digits=7, decimal_places=2, default=Decimal("0"), validators=[MinValueValidator(0)])
    max_running_jobs = models.PositiveIntegerField(null=True, blank=True)
    max_time_limit_s = models.PositiveIntegerField(default=7 * 24 * 3600)
    # GPU-hours a month; None means no budget.
    gpu_hours_budget = models.DecimalField(max_digits=12, decimal_places=2, null=True, blank=True)
    budget_hard_stop = models.BooleanField(default=False)
    allowed_gpu_types = models.JSONField(default=list, blank=True)  # empty: any model
    allowed_images = models.JSONField(default=list, blank=True)
    network_allowed = models.BooleanField(default=False)
    # Cancel running jobs the idle detector flags (GPUs under GPU_IDLE_UTIL_PCT for GPU_IDLE_MINUTES).
    idle_auto_cancel = models.BooleanField(default=False)
    # Days its jobs' artifacts are kept after upload; None: the site's ARTIFACTS_RETENTION_DAYS; 0: forever.
    artifact_retention_days = models.PositiveIntegerField(null=True, blank=True)

    objects = QuotaQuerySet.as_manager()

    def __str__(self) -> str:
        return f"quota of {self.project}"
