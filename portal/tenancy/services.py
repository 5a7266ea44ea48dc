"""Writes for organizations, projects, memberships and quotas.

Membership services are the only code that grants or revokes guardian
permissions on a Project, so roles and permissions never drift apart.
"""
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from guardian.shortcuts import assign_perm, remove_perm

from portal.core.context import Actor
from portal.core.errors import Conflict, Forbidden, InvalidInput
from portal.core.services import audit_record, require_operator
from portal.core.text import check_plain_name

from .access import check_token_project, user_can
from .models import ALL_PROJECT_PERMS, ROLE_PERMS, Membership, Organization, Project, Quota, Role

User = get_user_model()


def _sync_perms(*, user, project: Project, role: str | None) -> None:
    """Make the user's guardian permissions on `project` exactly those of `role`."""
    wanted = ROLE_PERMS.get(role, set()) if role else set()
    for perm in ALL_PROJECT_PERMS:
        if perm in wanted:
            assign_perm(f"tenancy.{perm}", user, project)
        else:
            remove_perm(f"tenancy.{perm}", user, project)


def _require_manage(actor: Actor, project: Project) -> None:
    check_token_project(actor, project)
    if not user_can(actor.user, "manage", project):
        raise Forbidden(f"You need the owner or admin role in project {project.slug} to do this.")


def _actor_is_owner(actor: Actor, project: Project) -> bool:
    if actor.is_staff:
        return True
    return Membership.objects.filter(project=project, user=actor.user, role=Role.OWNER).exists()


def organization_create(*, actor: Actor, slug: str, name: str, max_gpus: int | None = None) -> Organization:
    require_operator(actor, "Only site staff can create organizations.")
    check_plain_name(name)
    with transaction.atomic():
        if Organization.objects.filter(slug=slug).exists():
            raise InvalidInput(f"An organization with slug {slug!r} already exists.", field="slug")
        org = Organization.objects.create(slug=slug, name=name, max_gpus=max_gpus)
        audit_record(actor=actor, action="organization.create", obj=org, slug=slug)
    return org


def project_create(*, actor: Actor, organization: Organization, slug: str, name: str, description: str = "",
                   owner=None, quota: dict | None = None) -> Project:
    """Create a project with its quota; `owner` (a User) becomes its first owner."""
    require_operator(actor, "Only site staff can create projects.")
    check_plain_name(name)
    try:
        with transaction.atomic():
            if Project.objects.filter(slug=slug).exists():
                raise InvalidInput(f"A project with slug {slug!r} already exists.", field="slug")
            project = Project.objects.create(organization=organization, slug=slug, name=name, description=description)
            Quota.objects.create(project=project, **(quota or {}))
            audit_record(actor=actor, action="project.create", obj=project, project=project,
                         organization=organization.slug)
            if owner is not None:
                _membership_write(actor=actor, project=project, user=owner, role=Role.OWNER)
    except IntegrityError:
        # A concurrent create won the unique slug.
        raise InvalidInput(f"A project with slug {slug!r} already exists.", field="slug") from None
    return project


def project_update(*, actor: Actor, project: Project, **changes) -> Project:
    _require_manage(actor, project)
    allowed = {"name", "description"}
    unknown = set(changes) - allowed
    if unknown:
        raise InvalidInput("This field cannot be changed here.", field=sorted(unknown)[0])
    if "name" in changes:
        check_plain_name(changes["name"])
    with transaction.atomic():
        for key, value in changes.items():
            setattr(project, key, value)
        project.save(update_fields=list(changes) or None)
        audit_record(actor=actor, action="project.update", obj=project, project=project, changes=changes)
    return project


def quota_update(*, actor: Actor, project: Project, **changes) -> Quota:
    """Quotas are set by operators: a tenant never raises its own limits."""
    require_operator(actor, "Only site staff can change quotas.")
    check_token_project(actor, project)
    with transaction.atomic():
        quota = Quota.objects.select_for_update().get(project=project)
        for key, value in changes.items():
            setattr(quota, key, value)
        guaranteed, maximum = quota.guaranteed_gpus, quota.max_gpus
        if maximum < guaranteed:
            raise InvalidInput(
                f"max_gpus ({maximum}) must be at least guaranteed_gpus ({guaranteed}).", field="max_gpus"
            )
        quota.save()
        audit_record(actor=actor, action="quota.update", obj=quota, project=project,
                     changes={k: str(v) if not isinstance(v, (list, bool, int, type(None))) else v
                              for k, v in changes.items()})
    return quota


def _membership_write(*, actor: Actor, project: Project, user, role: str) -> Membership:
    membership, created = Membership.objects.update_or_create(project=project, user=user, defaults={"role": role})
    _sync_perms(user=user, project=project, role=role)
    audit_record(actor=actor, action="membership.create" if created else "membership.update", obj=membership,
                 project=project, user=user.get_username(), role=role)
    return membership


def _owner_count(project: Project) -> int:
    return Membership.objects.filter(project=project, role=Role.OWNER).count()


def membership_add(*, actor: Actor, project: Project, username: str, role: str) -> Membership:
    _require_manage(actor, project)
    if role not in Role.values:
        raise InvalidInput(f"Unknown role {role!r}; use one of {', '.join(Role.values)}.", field="role")
    if role == Role.OWNER and not _actor_is_owner(actor, project):
        raise Forbidden("Only an owner can add owners.", field="role")
    user = User.objects.filter(username=username, is_active=True).first()
    if user is None:
        raise InvalidInput(f"No active user named {username!r}.", field="username")
    with transaction.atomic():
        if Membership.objects.filter(project=project, user=user).exists():
            raise Conflict(f"{username} is already a member of {project.slug}; change their role instead.",
                           field="username")
        return _membership_write(actor=actor, project=project, user=user, role=role)


def membership_change_role(*, actor: Actor, membership: Membership, role: str) -> Membership:
    project = membership.project
    _require_manage(actor, project)
    if role not in Role.values:
        raise InvalidInput(f"Unknown role {role!r}; use one of {', '.join(Role.values)}.", field="role")
    touches_owner = role == Role.OWNER or membership.role == Role.OWNER
    if touches_owner and not _actor_is_owner(actor, project):
        raise Forbidden("Only an owner can grant or change the owner role.", field="role")
    with transaction.atomic():
        # Lock the project's owner rows so two demotions cannot both pass the last-owner check.
        list(Membership.objects.select_for_update().filter(project=project, role=Role.OWNER))
        if membership.role == Role.OWNER and role != Role.OWNER and _owner_count(project) <= 1:
            raise Conflict("A project must keep at least one owner.", field="role")
        return _membership_write(actor=actor, project=project, user=membership.user, role=role)


def membership_remove(*, actor: Actor, membership: Membership) -> None:
    project = membership.project
    check_token_project(actor, project)
    leaving_self = actor.user is not None and membership.user_id == actor.user.pk
    if not leaving_self:
        _require_manage(actor, project)
        if membership.role == Role.OWNER and not _actor_is_owner(actor, project):
            raise Forbidden("Only an owner can remove an owner.")
    with transaction.atomic():
        list(Membership.objects.select_for_update().filter(project=project, role=Role.OWNER))
        if membership.role == Role.OWNER and _owner_count(project) <= 1:
            raise Conflict("A project must keep at least one owner.")
        user = membership.user
        audit_record(actor=actor, action="membership.delete", obj=membership, project=project,
                     user=user.get_username(), role=membership.role)
        membership.delete()
        _sync_perms(user=user, project=project, role=None)
