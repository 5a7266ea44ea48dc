from celery import shared_task

from .services import tick as run


@shared_task(name="autoscale.tick", ignore_result=True)
def tick() -> dict:
    return run()
