"""The API's per-user rate limit (portal/core/throttling.py) against the real Redis of REDIS_URL:
a request over the rate is a 429 with Retry-After, a refused one is not counted, another user has
a limit of their own, the previous window still weighs in, and each request costs one counter,
not a list of every request time."""
import pytest
from django.conf import settings
from django.core.cache import cache

from portal.core.throttling import UserRateThrottle
from tests.conftest import make_token


@pytest.fixture
def rate(monkeypatch):
    assert settings.CACHES["default"]["BACKEND"] == "portal.core.cache.ResilientRedisCache", "set REDIS_URL"
    monkeypatch.setattr(UserRateThrottle, "THROTTLE_RATES", {**UserRateThrottle.THROTTLE_RATES, "user": "5/min"})
    now = [1_000_000 * 60.0 + 30.0]  # half-way into a fixed window of a minute
    monkeypatch.setattr(UserRateThrottle, "timer", lambda self: now[0])
    yield now
    client = cache._cache.get_client("x", write=True)
    for key in client.scan_iter(cache.make_key("throttle_user_*")):
        client.delete(key)


@pytest.mark.django_db
def test_requests_over_the_users_rate_are_429_with_retry_after_and_not_counted(demo, api, rate):
    alice = api(token=make_token(demo.users["alice"]))
    bob = api(token=make_token(demo.users["bob"]))
    assert [alice.get("/api/v1/me/").status_code for _ in range(5)] == [200] * 5
    refused = alice.get("/api/v1/me/")
    assert refused.status_code == 429 and 0 < int(refused["Retry-After"]) <= 30
    assert alice.get("/api/v1/me/").status_code == 429
    assert bob.get("/api/v1/me/").status_code == 200  # a limit each
    # The refused ones were taken back: the counter holds alice's five.
    window = int(rate[0] // 60)
    assert cache.window_counts(f"throttle_user_{demo.users['alice'].pk}", window, 121)[0] == 6  # + this probe

    rate[0] += 60  # the next window, half-way: the previous one's six still weigh three
    assert [alice.get("/api/v1/me/").status_code for _ in range(2)] == [200, 200]  # 3 + 2 = 5
    refused = alice.get("/api/v1/me/")
    assert refused.status_code == 429
    # The next request (this window's third) fits once the previous six weigh two: 40 s into it, 10 s on.
    assert int(refused["Retry-After"]) == 10
    rate[0] += 9
    assert alice.get("/api/v1/me/").status_code == 429
    rate[0] += 1
    assert alice.get("/api/v1/me/").status_code == 200


@pytest.mark.django_db
def test_a_request_costs_one_small_counter_in_redis(demo, api, rate):
    alice = api(token=make_token(demo.users["alice"]))
    for _ in range(4):
        assert alice.get("/api/v1/me/").status_code == 200
    client = cache._cache.get_client("x")
    keys = list(client.scan_iter(cache.make_key(f"throttle_user_{demo.users['alice'].pk}*")))
    assert len(keys) == 1 and int(client.get(keys[0])) == 4
    assert 60 < client.ttl(keys[0]) <= 121
