"""The one family of errors services raise; portal.core.api maps them to HTTP.

Plain Python: a serializer's errors become an InvalidInput through `check_valid` or
`InvalidInput.from_detail`, so no service raises DRF's ValidationError and no view catches it.
"""
from collections.abc import Mapping


def flatten(detail, prefix: str = "") -> dict[str, list[str]]:
    """Nested field errors (a serializer's) -> {"field.sub": ["message", ...]}; a list of
    objects is indexed (`jobs[2].name`), a bare message is `non_field_errors`."""
    out: dict[str, list[str]] = {}
    if isinstance(detail, Mapping):
        for key, value in detail.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            for k, v in flatten(value, name).items():
                out.setdefault(k, []).extend(v)
    elif isinstance(detail, list):
        if all(not isinstance(item, (Mapping, list)) for item in detail):
            out[prefix or "non_field_errors"] = [str(item) for item in detail]
        else:
            for index, item in enumerate(detail):
                for k, v in flatten(item, f"{prefix}[{index}]" if prefix else str(index)).items():
                    out.setdefault(k, []).extend(v)
    else:
        out[prefix or "non_field_errors"] = [str(detail)]
    return out


class ServiceError(Exception):
    """A request the service refuses, with a message a person can act on.

    `field` names the input field at fault (a field-level message in the API);
    `code` is a stable machine-readable word.
    """

    status = 400
    default_code = "invalid"

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None,
                 fields: dict[str, list[str]] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code or self.default_code
        self.fields = fields

    def as_fields(self) -> dict[str, list[str]]:
        """{"field": ["message", ...]}: several fields' messages, or the one field's."""
        if self.fields is not None:
            return dict(self.fields)
        return {self.field: [self.message]} if self.field else {}


class InvalidInput(ServiceError):
    status = 400
    default_code = "invalid"

    @classmethod
    def from_detail(cls, detail) -> "InvalidInput":
        """Field errors, nested as a serializer gives them: the message is the general one, or
        the first few fields' first messages."""
        fields = flatten(detail)
        general = fields.pop("non_field_errors", None)
        message = general[0] if general else "Invalid input: " + "; ".join(
            f"{name}: {msgs[0]}" for name, msgs in list(fields.items())[:5])
        if general and len(general) > 1:
            fields["non_field_errors"] = general
        return cls(message, fields=fields)


def check_valid(serializer) -> dict:
    """A serializer's validated data, or an InvalidInput naming each field at fault."""
    if not serializer.is_valid():
        raise InvalidInput.from_detail(serializer.errors)
    return serializer.validated_data


class Forbidden(ServiceError):
    """The caller may see the object but not do this to it (an outsider gets NotFound)."""

    status = 403
    default_code = "permission_denied"


class NotFound(ServiceError):
    status = 404
    default_code = "not_found"


class Unprocessable(ServiceError):
    """Well-formed, but it cannot be honoured as sent (an Idempotency-Key reused with another request)."""

    status = 422
    default_code = "unprocessable"


class Conflict(ServiceError):
    """The object's current state forbids the action (cancel a finished job, budget spent)."""

    status = 409
    default_code = "conflict"
