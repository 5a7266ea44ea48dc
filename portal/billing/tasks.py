from celery import shared_task


@shared_task(name="billing.meter_usage", ignore_result=True)
def meter_usage() -> dict:
    """Beat runs this every BILLING_METER_INTERVAL_S; duplicates and retries are no-ops (upserted totals)."""
    from .services import usage_meter

    return usage_meter()
