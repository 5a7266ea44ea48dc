"""Celery's broker connection surviving a Redis restart, for the agent's app and the portal's.

kombu (5.7) can turn a lost Redis connection into a crash: when the connection drops while a channel
is polling (BRPOP) and holds unacknowledged messages (a task running with ``acks_late``), Celery's
consumer first collects the connection (its transport's ``client`` is cleared), then closes it; the
channel's close, cut short the first time by the dead socket, runs again and restores the unacked
messages through a new Redis pool built from that cleared client: ``AttributeError: 'NoneType' object
has no attribute 'hostname'``. Celery takes the AttributeError for an unrecoverable error and the
worker exits (the agent then stops heartbeating while it starts again, and its jobs' leases run out;
docs/reliability.md, F-06). ``guard_redis_channel_close`` makes that case the connection error it is,
which kombu ignores while closing, so the consumer reconnects as it does for any other lost connection.
The messages it could not restore are still unacknowledged in Redis (or gone with a Redis that kept
nothing): redelivered, or re-sent from the database (rule 1).
"""

from __future__ import annotations

# Celery settings both apps take: reconnect forever, at start and after a loss (a Redis outage of any
# length is waited out, never a reason to exit), and a channel error is as recoverable as a connection's.
CONNECTION_SETTINGS = {
    "broker_connection_retry": True,
    "broker_connection_retry_on_startup": True,
    "broker_connection_max_retries": None,
    "broker_channel_error_retry": True,
}


def guard_redis_channel_close() -> None:
    """Patch kombu's Redis channel once (idempotent): building a pool for a connection already closed
    raises redis' ConnectionError instead of AttributeError (module docstring)."""
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    if getattr(channel._connparams, "_gpuportal_guarded", False):
        return
    original = channel._connparams

    def _connparams(self, asynchronous=False):
        transport = self.connection
        if transport is None or transport.client is None:
            raise kombu_redis.redis.exceptions.ConnectionError("the broker connection is already closed")
        return original(self, asynchronous=asynchronous)

    _connparams._gpuportal_guarded = True
    channel._connparams = _connparams
