"""Parser and paginator named in REST_FRAMEWORK settings.

Kept apart from portal.core.api because DRF imports these while it defines
its views; this module must not import rest_framework.views.
"""
import json
import math
import re

from django.conf import settings
from rest_framework import exceptions, pagination, status
from rest_framework.parsers import JSONParser

from .numbers import parse_int

# Deeper than any body the API takes (a job spec is 3 levels); a bomb of nested brackets
# would otherwise exhaust the interpreter's stack (RecursionError) in the parser or after it.
JSON_MAX_DEPTH = 32


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "Request body too large."
    default_code = "payload_too_large"


class SizeLimitedJSONParser(JSONParser):
    """JSON only, at most DATA_UPLOAD_MAX_MEMORY_SIZE bytes and JSON_MAX_DEPTH levels, no
    NaN/Infinity (also none from a number too large for a float), no lone surrogates (they
    cannot be stored as UTF-8). Anything else is a 400 "Malformed JSON", never a 500."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if (parse_int(declared) or 0) > limit:
            raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
            if _SURROGATE_ESCAPE.search(raw):
                _check_nesting_and_text(data)
            else:
                _check_nesting(data)
        except RecursionError:
            raise exceptions.ParseError(f"Malformed JSON: nested deeper than {JSON_MAX_DEPTH} levels.") from None
        except (ValueError, UnicodeError) as exc:
            raise exceptions.ParseError(f"Malformed JSON: {exc}") from None
        return data


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range")
    return value


# Valid UTF-8 holds no surrogate, so a lone one can only come from a JSON escape such as \\ud800:
# a body without one needs no walk over its strings (every heartbeat).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_nesting(data) -> None:
    """Refuse more than JSON_MAX_DEPTH levels, one level at a time, looking at containers only."""
    level, depth = [data], 1
    while level:
        if depth > JSON_MAX_DEPTH and any(isinstance(v, (dict, list)) for v in level):
            raise ValueError(f"nested deeper than {JSON_MAX_DEPTH} levels")
        inner = []
        for value in level:
            if isinstance(value, (dict, list)):
                inner += [v for v in (value.values() if isinstance(value, dict) else value)
                          if isinstance(v, (dict, list))]
        level, depth = inner, depth + 1


def _check_nesting_and_text(data) -> None:
    """Walk the parsed body without recursion: refuse more than JSON_MAX_DEPTH levels, and
    strings (keys too) that are not valid Unicode text (a lone surrogate such as \\ud800)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            value.encode("utf-8")  # UnicodeEncodeError on a lone surrogate
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > JSON_MAX_DEPTH:
            raise ValueError(f"nested deeper than {JSON_MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                key.encode("utf-8")
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in value)


class Pagination(pagination.PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 500
