from celery import shared_task


@shared_task(name="metrics.rollup_minute", ignore_result=True)
def rollup_minute() -> int:
    from .services import rollup_minutes

    return rollup_minutes()


@shared_task(name="metrics.rollup_hour", ignore_result=True)
def rollup_hour() -> int:
    from .services import rollup_hours

    return rollup_hours()


@shared_task(name="metrics.prune", ignore_result=True)
def prune() -> dict:
    from .services import metrics_prune

    return metrics_prune()
