"""Celery tasks of the `scheduler` queue: thin wrappers around the services they are named after."""
from celery import shared_task


@shared_task(name="scheduler.schedule_pass", ignore_result=True)
def schedule_pass() -> dict:
    from .adapter import run_pass

    return run_pass(wait=True)
