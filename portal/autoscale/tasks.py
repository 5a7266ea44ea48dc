from celery import shared_task


@shared_task(name="autoscale.tick", ignore_result=True)
def tick() -> dict:
    from .services import tick as run

    return run()
