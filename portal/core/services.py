from django.db import models

from .context import Actor
from .models import AuditEvent


def audit_record(*, actor: Actor, action: str, obj: models.Model, project=None, **data) -> AuditEvent:
    """Write the audit row for a state-changing action. Call it inside the action's transaction."""
    user = actor.user
    label = actor.label or (user.get_username() if user is not None else "anonymous")
    return AuditEvent.objects.create(
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
