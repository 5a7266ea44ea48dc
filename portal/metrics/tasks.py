from celery import shared_task

from .services import jobs_flag_idle, metrics_prune, rollup_hours, rollup_minutes


@shared_task(name="metrics.rollup_minute", ignore_result=True)
def rollup_minute() -> int:
    return rollup_minutes()


@shared_task(name="metrics.rollup_hour", ignore_result=True)
def rollup_hour() -> int:
    return rollup_hours()


@shared_task(name="metrics.prune", ignore_result=True)
def prune() -> dict:
    return metrics_prune()


@shared_task(name="metrics.flag_idle_jobs", ignore_result=True)
def flag_idle_jobs() -> dict:
    return jobs_flag_idle()
