"""Shared API machinery: one error shape, strict input, scoped base viewset."""
from collections.abc import Mapping

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from rest_framework import exceptions, serializers, viewsets
from rest_framework.fields import _UnvalidatedField
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from .context import Actor, actor_from_request
from .errors import InvalidInput, ServiceError, flatten
from .rest import PayloadTooLarge


def error_body(status_code: int, code: str, message: str, fields: dict | None = None) -> dict:
    return {"error": {"status": status_code, "code": code, "message": message, "fields": fields or {}}}


def exception_handler(exc, context):
    """Every API error has one JSON shape: {"error": {status, code, message, fields}}."""
    if isinstance(exc, ServiceError):
        return Response(error_body(exc.status, exc.code, exc.message, exc.as_fields()), status=exc.status)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a real bug: let Django report the 500
    if isinstance(exc, exceptions.ValidationError):
        refusal = InvalidInput.from_detail(exc.detail)
        response.data = error_body(response.status_code, "invalid", refusal.message, refusal.as_fields())
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        code = getattr(exc, "default_code", "error")
        if isinstance(detail, (list, dict)):
            fields = flatten(detail)
            response.data = error_body(response.status_code, code, "Request refused.", fields)
        else:
            code = getattr(detail, "code", code) or code
            response.data = error_body(response.status_code, code, str(detail))
    return response


def holds_nul(value) -> bool:
    """A NUL character anywhere in a parsed JSON value (strings and keys, any depth)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def nul_escapes_checks(field, value) -> bool:
    """A NUL character that this field's own validation would let through to PostgreSQL (which
    cannot store or compare one: a 500): a slug lookup, free-form JSON, or a dict's keys (DRF
    checks a DictField's values only). Text fields refuse NUL themselves, with their own message."""
    if isinstance(field, (serializers.RelatedField, serializers.JSONField)):
        return holds_nul(value)
    if isinstance(field, (serializers.DictField, serializers.ListField)):
        if isinstance(field.child, (_UnvalidatedField, serializers.DictField, serializers.ListField,
                                    serializers.JSONField)):
            return holds_nul(value)
        return isinstance(field, serializers.DictField) and isinstance(value, Mapping) and any(
            isinstance(key, str) and "\x00" in key for key in value)
    return False


class StrictSerializerMixin:
    """Refuse unknown and read-only keys instead of silently dropping them (mass assignment),
    and NUL characters that a field's own checks would let through (nul_escapes_checks)."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            writable = {name for name, f in self.fields.items() if not f.read_only}
            readonly = {name for name, f in self.fields.items() if f.read_only}
            errors = {}
            for key, value in data.items():
                if key in writable:
                    # DRF would turn 5 into "5"; a wrong type is a client bug worth naming.
                    if isinstance(self.fields[key], serializers.CharField) and not (
                        isinstance(value, str) or (value is None and self.fields[key].allow_null)
                    ):
                        errors[key] = ["Expected a string."]
                    elif nul_escapes_checks(self.fields[key], value):
                        errors[key] = ["Null characters are not allowed."]
                    continue
                errors[key] = ["This field is read-only."] if key in readonly else ["Unknown field."]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


class StrictCharField(serializers.CharField):
    """A CharField that takes only strings (DRF's would turn 5 into "5")."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("Expected a string.")
        return super().to_internal_value(data)


class StrictSerializer(StrictSerializerMixin, serializers.Serializer):
    pass


# One bound instance per serializer class, for `validated`.
_checkers: dict[type, serializers.Serializer] = {}


def validated(serializer_class: type[serializers.Serializer], data) -> dict:
    """``serializer_class(data=data)``'s validated data, or its ValidationError (a 400 naming each
    field), for a serializer with no instance and no context (the agent's reports).

    A serializer built per request deep-copies and binds its declared fields, nested ones
    included: most of what checking a small body costs. A body is checked by one instance
    per class instead, whose fields keep no state between calls (DRF's fields read their
    parent, never write it). A refused body is checked again by a fresh serializer, so the
    error is the very one DRF gives (the null body's "No data provided" included)."""
    checker = _checkers.get(serializer_class)
    if checker is None:
        checker = serializer_class()
        checker.fields  # bound now, before the instance is shared
        _checkers[serializer_class] = checker
    if type(data) is dict:
        try:
            return checker.run_validation(data)
        except serializers.ValidationError:
            pass
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class StrictModelSerializer(StrictSerializerMixin, serializers.ModelSerializer):
    pass


class ActorMixin:
    @property
    def actor(self) -> Actor:
        return actor_from_request(self.request)


class TenantViewSet(ActorMixin, viewsets.GenericViewSet):
    """Base viewset: the queryset is restricted to what the caller may see before any handler runs.

    Subclasses set `scoped_model` (a model whose manager has `for_user`). Objects the
    caller may not see do not exist for them (404). Token scopes: safe methods need
    `read`; other actions need `scope_for_action[action]` or `write_scope`.
    """

    scoped_model = None
    write_scope = "admin"
    scope_for_action: dict[str, str] = {}
    #: actions that act beyond any one project (create an organization): a project-restricted
    #: token may not run them (accounts.auth.TokenScopePermission asks write_stays_in_project).
    account_wide_actions: frozenset[str] = frozenset()

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return self.scoped_model.objects.none()
        return self.scoped_model.objects.for_user(
            self.request.user, "view", project_id=self.actor.restricted_project_id
        )

    def write_stays_in_project(self) -> bool:
        """True when this write touches only rows of the projects the queryset shows, so a
        project-restricted token may make it (its service checks the project named in a body)."""
        return self.action not in self.account_wide_actions

    def required_scope(self) -> str:
        if self.action in self.scope_for_action:
            return self.scope_for_action[self.action]
        return "read" if self.request.method in ("GET", "HEAD", "OPTIONS") else self.write_scope
