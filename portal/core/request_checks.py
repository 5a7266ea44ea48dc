"""Checks every request passes before any view runs.

A NUL character can arrive percent-encoded (`%00`) in a URL, a query string or a header, but
PostgreSQL cannot hold one in a text column: every lookup by slug, name or username, and every
filter, would fail inside the database with a 500. No legitimate request carries one, so it is
refused here, once, for every present and future endpoint: 404 for a path (no such object can
exist), 400 naming the parameter for a query string or header.
"""
from django.http import Http404, JsonResponse
from django.http.response import HttpResponseBadRequest

from .api import error_body

NUL = "\x00"


def _refusal(request, status: int, message: str, fields: dict | None = None):
    if request.path.startswith("/api/"):
        return JsonResponse(error_body(status, "invalid" if status == 400 else "not_found", message, fields),
                            status=status)
    if status == 404:
        raise Http404(message)  # the site's own 404 page
    return HttpResponseBadRequest(message, content_type="text/plain; charset=utf-8")


class RefuseNulMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if NUL in request.path:
            return _refusal(request, 404, "Not found.")
        bad = [key for key, values in request.GET.lists() if NUL in key or any(NUL in v for v in values)]
        bad += [key[5:].lower().replace("_", "-") for key, value in request.META.items()
                if key.startswith("HTTP_") and isinstance(value, str) and NUL in value]
        if bad:
            message = "Null characters are not allowed."
            fields = {key.replace(NUL, "\\x00")[:64]: [message] for key in bad}
            return _refusal(request, 400, f"{next(iter(fields))}: {message}", fields)
        return self.get_response(request)
