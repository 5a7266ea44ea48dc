"""Answer 503 with Retry-After, not 500, while the database is unreachable.

PostgreSQL restarting or a network blip between the web and the database is an outage of
the portal, not a bug: API clients and node agents should retry after a few seconds, and
an agent must not count it against its node (agents/client.py reads `OUTAGE_HEADER`: the
portal answered, so its lease holds). Only connection-level errors are caught
(OperationalError, InterfaceError); a bad query is still a 500 with a report.
"""
import logging

from django.db import InterfaceError, OperationalError, connections
from django.http import HttpResponse, JsonResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
OUTAGE_HEADER = "X-Gpuportal-Outage"  # value: what is out ("database")


def _close_broken_connections() -> None:
    # A connection that died stays marked usable until Django notices: drop it so the next
    # request reconnects instead of failing on the dead socket.
    for conn in connections.all(initialized_only=True):
        try:
            conn.close_if_unusable_or_obsolete()
        except Exception:  # closing a dead socket can raise again; it is gone either way
            pass


class DatabaseOutageMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, (OperationalError, InterfaceError)):
            return None
        log.error("database unreachable during %s %s: %s", request.method, request.path, exception)
        _close_broken_connections()
        message = "The portal cannot reach its database right now; retry in a few seconds."
        if request.path.startswith("/api/"):
            response = JsonResponse({"error": {"status": 503, "code": "database_unavailable", "message": message,
                                               "fields": {}}}, status=503)
        else:
            response = HttpResponse(message, status=503, content_type="text/plain; charset=utf-8")
        response["Retry-After"] = str(RETRY_AFTER_S)
        response[OUTAGE_HEADER] = "database"
        return response
