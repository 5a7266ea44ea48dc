"""Celery tasks of the `scheduler` queue: thin wrappers around the services they are named after."""
from celery import shared_task

from .adapter import run_pass


@shared_task(name="scheduler.schedule_pass", ignore_result=True)
def schedule_pass() -> dict:
    return run_pass(wait=True)
