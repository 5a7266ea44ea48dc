"""What every app's views.py shares: tenancy through `for_user`, refusals people can read,
and the "swap only what changed" helper htmx polls use.

Pages authenticate by session only (a Bearer token is nobody here), load tenant rows
through `Model.objects.for_user(user, action)` so an outsider gets 404, call one service,
and render. Permission rules live in the services: a refused action comes back as a
ServiceError, which `refused()` turns into a page.
"""
import hashlib
import re

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin, UserPassesTestMixin
from django.http import Http404
from django.shortcuts import redirect, render

from .context import actor_from_request
from .errors import ServiceError


def scoped_or_404(source, request, action: str = "view", **lookup):
    """One row of a tenant-owned model (or of a queryset of one) the user may see, else 404:
    an outsider learns nothing, not even that the row exists."""
    qs = source.objects.all() if isinstance(source, type) else source
    obj = qs.for_user(request.user, action).filter(**lookup).first()
    if obj is None:
        raise Http404(f"No {qs.model._meta.verbose_name} here.")
    return obj


class PageMixin(LoginRequiredMixin):
    """Base of every portal page: a logged-in user and the Actor services expect."""

    @property
    def actor(self):
        return actor_from_request(self.request)


class StaffPageMixin(PageMixin, UserPassesTestMixin):
    """Operator pages (nodes): staff only; a tenant gets 403, an anonymous visitor the login page."""

    def test_func(self):
        return self.request.user.is_staff


def refused(request, exc: ServiceError, *, back: str):
    """A service said no. Forbidden is a 403 page; anything else goes back with the message."""
    if exc.status == 403:
        return render(request, "core/refused.html", {"message": exc.message, "back": back}, status=403)
    messages.error(request, exc.message)
    return redirect(back)


CSRF_INPUT = re.compile(r'<input type="hidden" name="csrfmiddlewaretoken" value="[^"]*">')


def version(html: str) -> str:
    """A short fingerprint of rendered HTML: a poll answers 204 (no swap) when it has not changed.
    CSRF tokens are left out: Django masks them afresh on every render."""
    return hashlib.sha1(CSRF_INPUT.sub("", html).encode()).hexdigest()[:12]
