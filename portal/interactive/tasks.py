from celery import shared_task

from .services import sessions_cull


@shared_task(name="interactive.cull_sessions")
def cull_sessions() -> dict:
    """Warn idle sessions, stop the jobs of those idle past the grace or past their lifetime."""
    return sessions_cull()
