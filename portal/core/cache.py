"""The cache backend: Redis that degrades instead of failing.

The cache holds only what can be lost (the latest sample per GPU, throttle counters), so an
unreachable Redis must not fail a heartbeat, a page or an API call: reads answer their
default (a miss) and writes are dropped, with one warning per outage. After an error the
cache is skipped for `RETRY_AFTER_S`, so a Redis that hangs costs one socket timeout, not
one per request.
"""
import logging
import time

from django.core.cache.backends.redis import RedisCache, RedisCacheClient
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0


def _degrading(name: str, default_for, method=None):
    """Wrap RedisCache.<name> (or ``method``): on a Redis error answer default_for(*args) instead of raising."""
    method = method or getattr(RedisCache, name)

    def wrapper(self, *args, **kwargs):
        if time.monotonic() < self._down_until:
            return default_for(*args, **kwargs)
        try:
            value = method(self, *args, **kwargs)
        except (RedisError, OSError) as exc:  # ConnectionError, TimeoutError, BusyLoadingError...
            if not self._down_since:
                self._down_since = time.monotonic()
                log.warning("cache unreachable (%s: %s); going on without it", type(exc).__name__, exc)
            self._down_until = time.monotonic() + RETRY_AFTER_S
            return default_for(*args, **kwargs)
        if self._down_since:
            log.warning("cache reachable again after %.0fs", time.monotonic() - self._down_since)
            self._down_since = 0.0
        return value

    wrapper.__name__ = name
    return wrapper


class ReusingRedisClient(RedisCacheClient):
    """Django's Redis cache client, less two costs every heartbeat paid (about a sixth of its web CPU
    went to the cache): Django makes a new ``redis.Redis`` for every call (each builds a table of a few
    hundred response callbacks); one per connection pool serves every thread, as redis-py's clients
    are thread-safe and the pool holds the connections. And ``set_many`` sends one ``SET ... EX`` a
    key in a plain pipeline instead of a MULTI/EXEC transaction of MSET and an EXPIRE a key: a cache
    needs no atomicity across keys (the latest sample of 8 GPUs, say)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._clients = {}

    def get_client(self, key=None, *, write=False):
        pool = self._get_connection_pool(write)
        client = self._clients.get(id(pool))
        if client is None:
            client = self._clients[id(pool)] = self._client(connection_pool=pool)
        return client

    def set_many(self, data, timeout):
        client = self.get_client(None, write=True)
        if timeout == 0:  # as Django's: an expiry of 0 leaves nothing
            client.delete(*data)
            return
        pipeline = client.pipeline(transaction=False)
        for key, value in data.items():
            pipeline.set(key, self._serializer.dumps(value), ex=timeout)  # ex=None: no expiry
        pipeline.execute()


def _window_counts(self, key: str, window: int, ttl_s: int) -> tuple[int, int]:
    """Count one hit in fixed window ``window`` of ``key``: (its count now, the window before's),
    in one round trip; each window's counter expires ``ttl_s`` after its last hit."""
    current, previous = self.make_key(f"{key}:{window}"), self.make_key(f"{key}:{window - 1}")
    pipeline = self._cache.get_client(current, write=True).pipeline(transaction=False)
    pipeline.incr(current)
    pipeline.expire(current, ttl_s)
    pipeline.get(previous)
    count, _, before = pipeline.execute()
    return int(count), int(before or 0)


def _window_uncount(self, key: str, window: int) -> None:
    """Take back the hit ``window_counts`` counted (a refused request is not one)."""
    current = self.make_key(f"{key}:{window}")
    self._cache.get_client(current, write=True).decr(current)


def _flag_and_get(self, flag: str, ttl_s: int, other: str, value: str):
    """Set ``flag`` to ``value`` unless it is set (as ``add``) and read ``other``, in one round trip:
    (whether the flag was set now, ``other``'s bytes or None). Both are plain strings, not the
    cache's serialized values: ``flag_clear`` compares them in Redis."""
    flag_key, other_key = self.make_key(flag), self.make_key(other)
    pipeline = self._cache.get_client(flag_key, write=True).pipeline(transaction=False)
    pipeline.set(flag_key, value, nx=True, ex=ttl_s)
    pipeline.get(other_key)
    added, raw = pipeline.execute()
    return bool(added), raw


# Set KEYS[2] to ARGV[3] (for ARGV[4] s), then delete the flag KEYS[1] ("<set at> <owner>") if
# ARGV[1] owns it, it was set before ARGV[2], or it is in no such form (an older portal's "1").
_FLAG_CLEAR = """
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local at, owner = string.match(v, '^(%S+) (%S+)$')
if owner == ARGV[1] or not tonumber(at) or tonumber(at) < tonumber(ARGV[2]) then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _flag_clear(self, flag: str, owner: str, set_before: float, other: str, other_value: str, ttl_s: int) -> bool:
    """In one round trip: set ``other`` to ``other_value`` (a plain string, for ``ttl_s``), and delete
    ``flag`` (as ``flag_and_get`` set it: "<set at> <owner>") if ``owner`` set it, it was set
    before ``set_before``, or it is not in that form. Whether the flag was deleted."""
    flag_key, other_key = self.make_key(flag), self.make_key(other)
    client = self._cache.get_client(flag_key, write=True)
    return bool(client.eval(_FLAG_CLEAR, 2, flag_key, other_key, owner, repr(set_before), other_value, ttl_s))


class ResilientRedisCache(RedisCache):
    def __init__(self, server, params):
        super().__init__(server, params)
        self._class = ReusingRedisClient
        self._down_until = 0.0
        self._down_since = 0.0

    get = _degrading("get", lambda key, default=None, *a, **k: default)
    get_many = _degrading("get_many", lambda *a, **k: {})
    has_key = _degrading("has_key", lambda *a, **k: False)
    set = _degrading("set", lambda *a, **k: None)
    add = _degrading("add", lambda *a, **k: False)
    touch = _degrading("touch", lambda *a, **k: False)
    set_many = _degrading("set_many", lambda data, *a, **k: list(data))  # the keys not stored
    delete = _degrading("delete", lambda *a, **k: False)
    delete_many = _degrading("delete_many", lambda *a, **k: None)
    incr = _degrading("incr", lambda key, delta=1, *a, **k: delta)
    clear = _degrading("clear", lambda *a, **k: False)
    # Throttle counters (portal/core/throttling.py); not counted while Redis is out: nothing is throttled.
    window_counts = _degrading("window_counts", lambda *a, **k: (0, 0), _window_counts)
    window_uncount = _degrading("window_uncount", lambda *a, **k: None, _window_uncount)
    # The scheduling pass's request (portal/core/passes.py); while Redis is out every request publishes.
    flag_and_get = _degrading("flag_and_get", lambda *a, **k: (True, None), _flag_and_get)
    flag_clear = _degrading("flag_clear", lambda *a, **k: False, _flag_clear)
