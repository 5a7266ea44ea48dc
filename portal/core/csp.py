"""Content-Security-Policy on every response.

Django 5.2 has no Content-Security-Policy of its own (6.0 adds one); this is the small part
we need. The policy lives in settings.CONTENT_SECURITY_POLICY: scripts only from our own
static files (no inline script, no event-handler attributes, no eval), so a name or a log
line that slips past escaping still cannot run.
"""
from django.conf import settings


def policy_header(policy: dict[str, list[str]]) -> str:
    return "; ".join(" ".join([directive, *sources]) for directive, sources in policy.items())


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response
        self.header = policy_header(settings.CONTENT_SECURITY_POLICY)

    def __call__(self, request):
        response = self.get_response(request)
        if self.header and "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = self.header
        return response
