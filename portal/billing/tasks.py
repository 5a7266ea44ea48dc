from celery import shared_task

from .services import usage_meter


@shared_task(name="billing.meter_usage", ignore_result=True)
def meter_usage() -> dict:
    """Beat runs this every minute (portal/celery.py); duplicates and retries are no-ops (upserted totals)."""
    return usage_meter()
