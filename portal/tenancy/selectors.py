from django.conf import settings
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.models import Exists, OuterRef, Subquery

from portal.core.plainsql import columns, instance

from .models import ACTION_PERMS, Membership, Project, ProjectUserObjectPermission, Quota, allowed_project_ids, \
    staff_bypass


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


def project_for_submit(user, slug: str, *, project_id: int | None = None) -> Project | None:
    """The project named `slug` as `user` sees it (for_user "view", within `project_id` for a token
    restricted to one project), its quota loaded, with ``may_submit``: whether their role lets them
    submit there. One query; on PostgreSQL in plain SQL, as every submit reads it and compiling the
    ORM's query (tests/tenancy/test_project_for_submit.py holds the two to the same answer) cost more
    CPU than running it."""
    if connection.vendor != "postgresql" or user is None or not user.is_authenticated or not user.is_active:
        return Project.objects.for_user(user, "view", project_id=project_id).select_related("quota") \
            .filter(slug=slug).annotate(
                may_submit=Exists(allowed_project_ids(user, "submit").filter(pk=OuterRef("pk")))).first()
    content_type = (Project._meta.app_label, Project._meta.model_name)
    where, params = ["p.slug = %s"], [user.pk, ACTION_PERMS["submit"], *content_type, slug]
    if not staff_bypass(user, "view"):
        where.append(f"EXISTS ({_GRANTED})")
        params += [user.pk, ACTION_PERMS["view"], *content_type]
    if project_id is not None:
        where.append("p.id = %s")
        params.append(project_id)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {columns(Project, 'p')}, {columns(Quota, 'q')}, EXISTS ({_GRANTED}) "
            f"FROM {Project._meta.db_table} p LEFT JOIN {Quota._meta.db_table} q ON q.project_id = p.id "
            f"WHERE {' AND '.join(where)} ORDER BY p.id LIMIT 1", params)
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(Project._meta.concrete_fields)
    project = instance(Project, row[:split])
    if row[split] is not None:  # the quota's id: a project without one raises on .quota, as the ORM's does
        project.quota = instance(Quota, row[split:-1])
    project.may_submit = row[-1]
    return project


# allowed_project_ids as a correlated test on the project `p`: the user holds this permission on it.
_GRANTED = (f"SELECT 1 FROM {ProjectUserObjectPermission._meta.db_table} g "
            f"JOIN {Permission._meta.db_table} ap ON ap.id = g.permission_id "
            f"JOIN {ContentType._meta.db_table} ct ON ct.id = ap.content_type_id "
            f"WHERE g.content_object_id = p.id AND g.user_id = %s AND ap.codename = %s "
            f"AND ct.app_label = %s AND ct.model = %s")
