"""The single tenancy choke point: `Model.objects.for_user(user, action)`.

Every tenant-owned model's manager is built from TenantQuerySet with
`project_path` saying how to reach its Project. Visibility comes from
django-guardian object permissions on Project, which the membership services
keep in step with roles. Staff see (and manage) everything but submit only
where they are members.
"""
from django.db import models

from .errors import NotFound

ACTION_PERMS = {
    "view": "view_project",
    "submit": "submit_job",
    "manage": "manage_project",
}


def allowed_project_ids(user, action: str):
    """A subquery of Project ids on which `user` holds the permission for `action`."""
    from guardian.shortcuts import get_objects_for_user

    from portal.tenancy.models import Project

    if action not in ACTION_PERMS:
        raise ValueError(f"unknown tenant action {action!r}")
    return get_objects_for_user(
        user,
        f"tenancy.{ACTION_PERMS[action]}",
        klass=Project,
        use_groups=False,
        with_superuser=False,
        accept_global_perms=False,
    ).values("pk")


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


def check_token_project(actor, project) -> None:
    """A project-restricted token acts on its own project only; any other is not there for it.

    Viewsets already hide other projects from such a token; services check again, so a new
    view (or a serializer's choices, issue 12's H2) cannot open a way around the restriction.
    """
    restricted = actor.restricted_project_id
    if restricted is not None and project.pk != restricted:
        raise NotFound(f"No project named {project.slug!r}.", field="project")


def user_can(user, action: str, project) -> bool:
    """Object-level check on one project (403 for an insider lacking the role)."""
    if user is None or not user.is_authenticated or not user.is_active:
        return False
    if staff_bypass(user, action):
        return True
    # The same query as for_user (not user.has_perm, which lets superusers do anything):
    # staff submit jobs only where they are members.
    return allowed_project_ids(user, action).filter(pk=project.pk).exists()
