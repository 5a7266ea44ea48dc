from django.db import models

from .context import Actor
from .errors import Forbidden
from .models import AuditEvent
from .plainsql import insert


def require_operator(actor: Actor, refusal: str) -> None:
    """The one staff check of the services: site staff, or the portal acting on its own (a task,
    a health rule, manage.py: Actor.is_system), run the site (nodes, tenants, quotas, prices,
    invoices). Anyone else gets `refusal` as a 403."""
    if not (actor.is_staff or actor.is_system):
        raise Forbidden(refusal)


def audit_record(*, actor: Actor, action: str, obj: models.Model, project=None, **data) -> AuditEvent:
    """Write the audit row for a state-changing action. Call it inside the action's transaction."""
    user = actor.user
    label = actor.label or (user.get_username() if user is not None else "anonymous")
    event = AuditEvent(
        actor=user,
        actor_label=label,
        action=action,
        object_type=obj._meta.label_lower,
        object_id=str(obj.pk or ""),
        object_repr=str(obj)[:200],
        project=project,
        source_ip=actor.ip,
        token_prefix=getattr(actor.token, "prefix", "") or "",
        data=data,
    )
    insert(event)  # each state change writes one: a plain INSERT, not the ORM's compiled anew
    return event
