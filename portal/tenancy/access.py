"""Checks on one project, for services and views: may this user act on it, may this token."""
from portal.core.errors import NotFound

from .models import allowed_project_ids, staff_bypass


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
