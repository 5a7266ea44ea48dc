from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.utils import timezone

from portal.core.context import Actor
from portal.core.errors import Conflict, Forbidden, InvalidInput
from portal.core.plainsql import columns, instance
from portal.core.services import audit_record
from portal.core.text import check_plain_name

from . import tokens
from .models import ApiToken, NotificationPreference, Scope


# Each generation costs a query when a token authenticates (every ancestor must still be usable).
MAX_TOKEN_GENERATIONS = 4


def _generation(token: ApiToken) -> int:
    """1 for a token created in a session, 2 for one created with such a token, and so on."""
    depth, parent_id = 1, token.parent_id
    while parent_id is not None and depth <= MAX_TOKEN_GENERATIONS:
        parent_id = ApiToken.objects.filter(pk=parent_id).values_list("parent_id", flat=True).first()
        depth += 1
    return depth


def token_issue(*, actor: Actor, user, name: str, scopes: list[str], project=None,
                expires_days: int | None = None) -> tuple[ApiToken, str]:
    """Create a token for `user`; returns the row and the secret, which is never stored.

    A token cannot mint a token wider than itself: same or fewer scopes, the same
    project restriction, and no later expiry (without `expires_days` the default is
    cut to the parent's). The child records its parent and dies with it: revoking
    the parent revokes it, and authentication refuses it once the parent is unusable.
    """
    check_plain_name(name)
    scopes = sorted(set(scopes))
    if not scopes:
        raise InvalidInput("Choose at least one scope.", field="scopes")
    unknown = [s for s in scopes if s not in Scope.values]
    if unknown:
        raise InvalidInput(f"Unknown scope {unknown[0]!r}; use {', '.join(Scope.values)}.", field="scopes")
    days = settings.TOKEN_DEFAULT_EXPIRY_DAYS if expires_days is None else expires_days
    if not 1 <= days <= settings.TOKEN_MAX_EXPIRY_DAYS:
        raise InvalidInput(f"expires_days must be between 1 and {settings.TOKEN_MAX_EXPIRY_DAYS}.",
                           field="expires_days")
    expires_at = timezone.now() + timedelta(days=days)
    parent = actor.token
    if parent is not None:
        if _generation(parent) >= MAX_TOKEN_GENERATIONS:
            raise Forbidden(f"Tokens created with tokens go {MAX_TOKEN_GENERATIONS} generations deep at most; "
                            "create this one in the browser.")
        wider = [s for s in scopes if not parent.has_scope(s)]
        if wider:
            raise Forbidden(f"This token cannot grant the {wider[0]!r} scope it does not hold itself.",
                            field="scopes")
        if parent.project_id is not None and (project is None or project.pk != parent.project_id):
            raise Forbidden("A project-restricted token can only create tokens for the same project.",
                            field="project")
        if parent.expires_at is not None and expires_at > parent.expires_at:
            if expires_days is not None:
                raise InvalidInput(f"This token expires at {parent.expires_at:%Y-%m-%d %H:%M} UTC; a token it "
                                   "creates cannot outlive it.", field="expires_days")
            expires_at = parent.expires_at
    secret = tokens.generate()
    with transaction.atomic():
        token = ApiToken.objects.create(
            user=user, name=name, prefix=secret[: tokens.PREFIX_LEN], digest=tokens.digest(secret),
            scopes=scopes, project=project, expires_at=expires_at, parent=parent,
        )
        audit_record(actor=actor, action="token.create", obj=token, project=project,
                     scopes=scopes, expires_at=token.expires_at.isoformat())
    return token, secret


def token_revoke(*, actor: Actor, token: ApiToken) -> ApiToken:
    """Revoke a token and every token minted with it, at any depth."""
    now = timezone.now()
    with transaction.atomic():
        updated = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now)
        if not updated:
            raise Conflict("This token is already revoked.")
        descendants, level = [], [token.pk]
        while level:
            level = list(ApiToken.objects.filter(parent_id__in=level).values_list("pk", flat=True))
            descendants += level
        children = ApiToken.objects.filter(pk__in=descendants, revoked_at__isnull=True).update(revoked_at=now)
        token.refresh_from_db()
        audit_record(actor=actor, action="token.revoke", obj=token, project=token.project, children_revoked=children)
    return token


def _usable_token(digest: str) -> ApiToken | None:
    """ApiToken.objects.usable().select_related("user").filter(digest=digest).first(); on PostgreSQL
    in plain SQL: every API request authenticates, and compiling the ORM's join cost more CPU
    than running it (the token's project and parent load when something asks for them)."""
    if connection.vendor != "postgresql":
        return ApiToken.objects.usable().select_related("user").filter(digest=digest).first()
    user_model = get_user_model()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {columns(ApiToken, 't')}, {columns(user_model, 'u')} FROM {ApiToken._meta.db_table} t "
            f"JOIN {user_model._meta.db_table} u ON u.{user_model._meta.pk.column} = t.user_id "
            f"WHERE t.digest = %s AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > %s) "
            f"LIMIT 1", [digest, timezone.now()])
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(ApiToken._meta.concrete_fields)
    token = instance(ApiToken, row[:split])
    token.user = instance(user_model, row[split:])
    return token


def token_authenticate(secret: str) -> ApiToken | None:
    """The usable token for `secret`, or None. Records the last use at most once a minute."""
    if not tokens.looks_valid(secret):
        return None
    token = _usable_token(tokens.digest(secret))
    if token is None or not token.user.is_active:
        return None
    # A minted token lives only while every token above it does (revoke cascades, but a
    # revocation made in the admin or by hand must hold too).
    ancestor = token.parent
    while ancestor is not None:
        if not ancestor.is_active:
            return None
        ancestor = ancestor.parent  # one query per level; chains are short
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > timedelta(minutes=1):
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token


def notification_preferences_update(*, actor: Actor, user, **changes):
    """Set a person's email preferences (job_succeeded, job_failed, job_preempted, job_idle)."""
    with transaction.atomic():
        prefs, _ = NotificationPreference.objects.select_for_update().get_or_create(user=user)
        for key, value in changes.items():
            setattr(prefs, key, value)
        prefs.save()
        audit_record(actor=actor, action="notifications.update", obj=prefs, **changes)
    return prefs
