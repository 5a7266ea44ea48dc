"""Logging filters that keep routine traffic out of the log (settings.LOGGING uses them).

An idle installation heartbeats, schedules and meters all the time; a person reading the log
wants what changed. Routine lines are still there at LOG_LEVEL=DEBUG.
"""
import logging

# Requests agents make every few seconds; an error among them (4xx, 5xx) is always logged.
ROUTINE_PATHS = ("/api/agent/v1/heartbeat", "/api/agent/v1/jobs/")


class RoutineRequests(logging.Filter):
    """Drops the development server's lines for successful agent API requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if status is None or status >= 400 or logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        request = getattr(record, "request", None)
        path = getattr(request, "path", "") or (record.args[0] if record.args else "")
        return not any(p in str(path) for p in ROUTINE_PATHS)
