"""Whole numbers from text that people and agents send: ASCII digits only, bounded.

`str.isdigit()` and `int()` disagree, so a check with one and a parse with the other is a
500 waiting to happen: '²'.isdigit() is True but int('²') raises, while int('١٢') is 12 and
int(' 7 ') is 7. Every id or count read from a URL, a query string, a form or an agent's
report goes through `parse_int` instead.
"""
import re

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

# 18 digits: every value fits PostgreSQL's bigint, so a lookup can never overflow a column.
_DIGITS = re.compile(r"[0-9]{1,18}")


def parse_int(value, *, default=None, max_value: int | None = None):
    """`value` as an int if it is an int (not a bool) or a string of ASCII digits, else `default`.

    Negative numbers are not ids or counts: they get `default` too, as does anything above
    `max_value` when it is given.
    """
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and _DIGITS.fullmatch(value):
        number = int(value)
    else:
        return default
    if number < 0 or (max_value is not None and number > max_value):
        return default
    return number


def parse_ints(values, *, limit: int) -> list[int]:
    """The valid ids among `values` (a list from a form or a report), at most `limit` of them."""
    out = []
    for value in values:
        number = parse_int(value)
        if number is not None:
            out.append(number)
            if len(out) >= limit:
                break
    return out


def count_or_fraction(value):
    """A GPU count for JSON: whole counts as integers (2, not 2.0 or "2.000"), a share as a float."""
    if value is None:
        return None
    return int(value) if value == int(value) else float(value)


@extend_schema_field({"type": "number"})
class GPUCountField(serializers.DecimalField):
    """A decimal GPU figure (a quota, a job's GPUs) that reads as a JSON number: 4, or 0.5."""

    def to_representation(self, value):
        return count_or_fraction(value)
