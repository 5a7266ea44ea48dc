"""/metrics: Prometheus text for staff (session or API token) and for a configured scrape token."""
import hmac

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from rest_framework import authentication, exceptions, permissions, renderers
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.views import APIView

from .collectors import registry

SCRAPE = "metrics-scrape-token"


class ScrapeTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer <METRICS_SCRAPE_TOKEN>`; other bearer tokens fall through to the API tokens."""

    def authenticate(self, request):
        expected = settings.METRICS_SCRAPE_TOKEN
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not expected or len(header) != 2 or header[0].lower() != "bearer":
            return None
        if hmac.compare_digest(header[1].encode(), expected.encode()):
            return AnonymousUser(), SCRAPE
        return None

    def authenticate_header(self, request):
        return "Bearer"


class StaffOrScrapeToken(permissions.BasePermission):
    message = "Only site staff or the metrics scrape token may read /metrics."

    def has_permission(self, request, view):
        if request.auth == SCRAPE:
            return True
        if not (request.user and request.user.is_authenticated):
            raise exceptions.NotAuthenticated()
        return bool(request.user.is_staff)


class FirstRenderer(BaseContentNegotiation):
    """Prometheus asks for text/plain or OpenMetrics; errors still use the API's JSON shape."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


@extend_schema(exclude=True)  # Prometheus text, not part of the JSON API's OpenAPI document
class PrometheusView(APIView):
    authentication_classes = [ScrapeTokenAuthentication, *APIView.authentication_classes]
    permission_classes = [StaffOrScrapeToken, *APIView.permission_classes[1:]]
    renderer_classes = [renderers.JSONRenderer]
    content_negotiation_class = FirstRenderer
    throttle_classes = []  # a scraper polls on a fixed period; the token or staff login is the gate

    def required_scope(self) -> str:
        return "read"

    def get(self, request):
        return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)
