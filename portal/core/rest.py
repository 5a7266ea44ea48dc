"""Parser and paginator named in REST_FRAMEWORK settings.

Kept apart from portal.core.api because DRF imports these while it defines
its views; this module must not import rest_framework.views.
"""
import json

from django.conf import settings
from rest_framework import exceptions, pagination, status
from rest_framework.parsers import JSONParser


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "Request body too large."
    default_code = "payload_too_large"


class SizeLimitedJSONParser(JSONParser):
    """JSON only, at most DATA_UPLOAD_MAX_MEMORY_SIZE bytes, no NaN/Infinity."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"Malformed JSON: {exc}") from None


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


class Pagination(pagination.PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 500
