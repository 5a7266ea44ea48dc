from django.conf import settings
from django.db.models import OuterRef, Subquery

from .models import Membership, Project, Quota


def projects_for_home(*, user):
    """The projects a user sees on the home page, with their role and quota, in one query."""
    my_role = Membership.objects.filter(project=OuterRef("pk"), user=user).values("role")[:1]
    return (
        Project.objects.for_user(user, "view")
        .select_related("organization", "quota")
        .annotate(role=Subquery(my_role))
        .order_by("organization__slug", "slug")
    )


def artifact_retention_days(project) -> int:
    """Days the artifacts of ``project``'s jobs are kept after upload (0: forever): its quota's
    artifact_retention_days, else the site's ARTIFACTS_RETENTION_DAYS."""
    try:
        days = project.quota.artifact_retention_days
    except Quota.DoesNotExist:
        days = None
    return settings.ARTIFACTS_RETENTION_DAYS if days is None else days
