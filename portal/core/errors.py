"""The one family of errors services raise; portal.core.api maps them to HTTP."""


class ServiceError(Exception):
    """A request the service refuses, with a message a person can act on.

    `field` names the input field at fault (a field-level message in the API);
    `code` is a stable machine-readable word.
    """

    status = 400
    default_code = "invalid"

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code or self.default_code

    def as_fields(self) -> dict[str, list[str]]:
        return {self.field: [self.message]} if self.field else {}


class InvalidInput(ServiceError):
    status = 400
    default_code = "invalid"


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
