"""`{% load durations %}`: how long something took, for tables that live-update."""
from django import template

register = template.Library()


@register.filter
def duration(seconds) -> str:
    """Whole minutes ("<1m", "12m", "1h05m", "2d3h"): a live row then changes once a minute,
    not on every poll. None (never started) is an em dash."""
    if seconds is None:
        return "—"
    minutes = int(seconds) // 60
    if minutes < 1:
        return "<1m"
    days, rest = divmod(minutes, 24 * 60)
    hours, minutes = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m"
