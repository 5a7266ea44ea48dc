"""Who is acting: passed to every service that changes state, for checks and the audit log."""
from dataclasses import dataclass
from typing import Any


class ActorToken:
    """What a personal API token is to the actor: accounts.ApiToken inherits it, so a request's
    `auth` is known for one without this layer importing accounts (a node's token or the metrics
    scrape token is not one). `project_id`: the one project it is restricted to, or None."""

    project_id: int | None


@dataclass(frozen=True)
class Actor:
    user: Any  # django.contrib.auth User, or None for the system itself
    token: ActorToken | None = None  # accounts.ApiToken when the request came with a Bearer token
    ip: str | None = None
    label: str = ""  # what acts when there is no user: "system", "scheduler", "node:gpu-01"

    @property
    def is_staff(self) -> bool:
        return bool(self.user is not None and self.user.is_staff)

    @property
    def is_system(self) -> bool:
        """The portal acting on its own (health rules, idle detection): no user, a label.
        actor_from_request never sets a label, so no request can pass for one."""
        return self.user is None and bool(self.label)

    @property
    def restricted_project_id(self) -> int | None:
        return getattr(self.token, "project_id", None)


SYSTEM = Actor(user=None, label="system")


def client_ip(request) -> str | None:
    # REMOTE_ADDR only: X-Forwarded-For is client-controlled unless a trusted proxy rewrites it.
    return request.META.get("REMOTE_ADDR") or None


def actor_from_request(request) -> Actor:
    auth = getattr(request, "auth", None)
    token = auth if isinstance(auth, ActorToken) else None
    user = request.user if request.user.is_authenticated else None
    return Actor(user=user, token=token, ip=client_ip(request))
