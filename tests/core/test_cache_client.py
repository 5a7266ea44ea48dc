"""The cache's Redis client (portal/core/cache.py): one redis client per connection pool, and
set_many's expiries as Django's own client sets them, against the real Redis of REDIS_URL."""
import uuid

import pytest
from django.conf import settings
from django.core.cache import caches


@pytest.fixture
def cache():
    assert settings.CACHES["default"]["BACKEND"] == "portal.core.cache.ResilientRedisCache", "set REDIS_URL"
    c = caches.create_connection("default")
    c.key_prefix = f"test-{uuid.uuid4().hex[:8]}"
    yield c
    c.delete_many(["a", "b", "c"])  # its own keys only: the database is the test run's


def ttl(cache, key):
    return cache._cache.get_client(key).ttl(cache.make_and_validate_key(key))


def test_set_many_stores_every_value_with_its_expiry(cache):
    cache.set_many({"a": {"utilization": 50}, "b": [1, 2]}, timeout=300)
    assert cache.get_many(["a", "b"]) == {"a": {"utilization": 50}, "b": [1, 2]}
    assert 290 < ttl(cache, "a") <= 300 and 290 < ttl(cache, "b") <= 300
    cache.set_many({"a": 1}, timeout=None)  # no expiry
    assert cache.get("a") == 1 and ttl(cache, "a") == -1
    cache.set_many({"a": 2, "b": 3}, timeout=0)  # expires at once: nothing stays
    assert cache.get_many(["a", "b"]) == {}


def test_one_redis_client_serves_every_call(cache):
    first = cache._cache.get_client("a")
    assert cache._cache.get_client("b", write=True) is first  # one server: one pool, one client
    cache.set("c", 1)
    assert cache._cache.get_client("c") is first and cache.get("c") == 1
