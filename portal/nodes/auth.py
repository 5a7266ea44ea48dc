from django.contrib.auth.models import AnonymousUser
from rest_framework import authentication, exceptions, permissions

from .models import Node
from .services import node_authenticate


class NodeTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer gpn_...`: a node's agent. Valid on the agent API only."""

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not header or header[0].lower() != "bearer":
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header; use 'Bearer <token>'.")
        # A view that checks the token again itself (the heartbeat's UPDATE) may take it from memory.
        view = (getattr(request, "parser_context", None) or {}).get("view")
        node = node_authenticate(header[1], confirmed_later=getattr(view, "node_token_confirmed_later", False))
        if node is None:
            raise exceptions.AuthenticationFailed("Invalid node token.")
        return AnonymousUser(), node

    def authenticate_header(self, request):
        return "Bearer"


class IsNode(permissions.BasePermission):
    def has_permission(self, request, view):
        if not isinstance(request.auth, Node):
            raise exceptions.NotAuthenticated("A node token (gpn_...) is required.")
        return True
