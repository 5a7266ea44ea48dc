"""Celery tasks of the `scheduler` queue: thin wrappers around the services they are named after."""
from celery import shared_task

from .adapter import run_pass


@shared_task(name="scheduler.schedule_pass", ignore_result=True, bind=True)
def schedule_pass(self) -> dict:
    # Its id tells the pass whether it is the one a request queued (portal/core/passes.py).
    return run_pass(wait=True, task_id=self.request.id)
