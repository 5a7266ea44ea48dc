"""Checks on user-given text that other people read: names must show what they hold.

Unicode control (Cc) and format (Cf) characters are invisible or reorder what follows: a
right-to-left override makes `gpt-fdp.sh` read as `gpt-hs.pdf`, a zero-width space makes two
names that look alike differ. Names refuse them; free text (descriptions) may keep newlines.
"""
import unicodedata

from django.core.exceptions import ValidationError

from .errors import InvalidInput

HIDDEN_CATEGORIES = ("Cc", "Cf")


def hidden_character(text: str) -> str | None:
    """The first control or format character in `text`, or None."""
    return next((ch for ch in text if unicodedata.category(ch) in HIDDEN_CATEGORIES), None)


def _message(ch: str) -> str:
    return (f"Names may not hold control or invisible formatting characters (U+{ord(ch):04X} "
            f"{unicodedata.name(ch, 'control character')}).")


def plain_name(value: str) -> None:
    """Validator for serializer and form fields."""
    if isinstance(value, str) and (ch := hidden_character(value)) is not None:
        raise ValidationError(_message(ch), code="hidden_character")


def check_plain_name(value: str, *, field: str = "name") -> None:
    """The same rule for services: InvalidInput naming the field."""
    if isinstance(value, str) and (ch := hidden_character(value)) is not None:
        raise InvalidInput(_message(ch), field=field)
