"""Query-string filters shared by the API's filtersets."""
from datetime import timezone as dt_timezone

import django_filters
from django import forms
from django_filters.fields import IsoDateTimeField


class UtcIsoDateTimeField(IsoDateTimeField):
    """An ISO 8601 time as UTC. Python takes offsets up to ±23:59 and PostgreSQL only up to
    ±15:59, so `2020-01-01T00:00+23:00` would reach the database as a 500: the offset is applied
    here, and a time that leaves the calendar when it is (year 1 minus an hour) is a 400."""

    def to_python(self, value):
        value = super().to_python(value)
        if value is None:
            return None
        try:
            return value.astimezone(dt_timezone.utc)
        except (OverflowError, ValueError):
            raise forms.ValidationError("Out of range: use a time between the years 1 and 9999.",
                                        code="invalid") from None


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField
