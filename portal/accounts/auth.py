from rest_framework import authentication, exceptions, permissions

from .models import ApiToken
from .services import token_authenticate


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer gpp_...`. Tokens in query strings are never read."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        parts = header.split()
        if parts[0].lower() != "bearer":
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header; use 'Bearer <token>'.")
        token = token_authenticate(parts[1])
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        return token.user, token

    def authenticate_header(self, request):
        return self.keyword


class TokenScopePermission(permissions.BasePermission):
    """A token may do only what its scopes allow; session users are limited by role alone."""

    def has_permission(self, request, view):
        token = request.auth
        if not isinstance(token, ApiToken):
            return True
        if hasattr(view, "required_scope"):
            scope = view.required_scope()
        else:
            scope = "read" if request.method in permissions.SAFE_METHODS else "admin"
        if not token.has_scope(scope):
            self.message = f"This token lacks the '{scope}' scope."
            return False
        if token.project_id is not None and request.method not in permissions.SAFE_METHODS:
            # A project-restricted token changes nothing outside its project. Only views that
            # say a write stays inside one project (TenantViewSet: its queryset already hides the
            # other projects) take one; any other view, present or future, refuses it.
            inside = getattr(view, "write_stays_in_project", None)
            if inside is None or not inside():
                self.message = (f"This token is restricted to project {token.project.slug}; "
                                "it cannot make changes outside that project.")
                return False
        return True
