"""Quiet by default: routine traffic (heartbeats, passes, beat) stays out of the log at INFO."""
import logging

from portal.core.logfilters import RoutineRequests


def record(request_line: str, status: int) -> logging.LogRecord:
    # What runserver logs: the request line as the first argument, the status as an extra.
    r = logging.LogRecord("django.server", logging.INFO, __file__, 1, '"%s" %s %s', (request_line, str(status), "38"),
                          None)
    r.status_code = status
    return r


def test_successful_agent_heartbeats_are_dropped_failures_and_people_kept():
    f = RoutineRequests()
    assert not f.filter(record("POST /api/agent/v1/heartbeat HTTP/1.1", 200))
    assert not f.filter(record("POST /api/agent/v1/jobs/7/logs HTTP/1.1", 200))
    assert f.filter(record("POST /api/agent/v1/heartbeat HTTP/1.1", 503))
    assert f.filter(record("POST /api/agent/v1/register HTTP/1.1", 200))
    assert f.filter(record("GET /jobs/7/ HTTP/1.1", 200))


def test_routine_loggers_are_above_info_by_default():
    for name in ("celery.beat", "celery.worker.strategy", "celery.app.trace"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
    assert logging.getLogger("scheduler.adapter").isEnabledFor(logging.INFO)
