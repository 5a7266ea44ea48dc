"""The API's per-user rate limit, counted in O(1) per request.

DRF's ``UserRateThrottle`` keeps every request time of the window in one cache entry, read, trimmed
and written back by each request: at the default 6,000 a minute, a busy client's request pickles,
sends and parses a list of thousands of floats twice, and two requests at once lose one of their
hits. This one counts hits in Redis (``window_counts``: an INCR of the current fixed window and a
read of the one before, in one round trip; a refused request is taken back) and weighs the previous
window by how much of it still lies within the sliding window, as nginx and Cloudflare estimate a
sliding window: the limit holds to within the rate's rounding, whatever the rate. Without Redis
(the embedded mode's in-process cache) DRF's own counting applies.
"""
from django.core.cache import cache
from rest_framework import throttling


class UserRateThrottle(throttling.UserRateThrottle):
    def allow_request(self, request, view):
        window_counts = getattr(cache, "window_counts", None)
        if self.rate is None or window_counts is None:
            return super().allow_request(request, view)
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        now = self.timer()
        window, into = divmod(now, self.duration)
        count, before = window_counts(self.key, int(window), int(2 * self.duration) + 1)
        left = 1.0 - into / self.duration  # the share of the previous window still inside the sliding one
        if before * left + count <= self.num_requests:
            self._wait = None
            return True
        cache.window_uncount(self.key, int(window))  # as DRF's: a refused request is not counted
        # When the next request's estimate (``count`` again) falls back under the limit: the previous
        # window's weight running out, or (this window alone over it) the next window.
        if count <= self.num_requests and before:
            self._wait = max(0.0, round((1.0 - (self.num_requests - count) / before) * self.duration - into, 3))
        else:
            self._wait = self.duration - into
        return False

    def wait(self):
        return getattr(self, "_wait", None)
