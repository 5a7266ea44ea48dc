from celery import shared_task

from .notifications import job_notify


@shared_task(name="jobs.notify", bind=True, ignore_result=True, max_retries=5, default_retry_delay=60)
def notify(self, job_id: int, attempt: int, kind: str) -> bool:
    """Queued after commit by notifications.notify_on_commit; idempotent (NotificationSent)."""
    try:
        return job_notify(job_id=job_id, attempt=attempt, kind=kind)
    except OSError as exc:  # SMTP down or refusing (smtplib errors are OSErrors): try again later
        raise self.retry(exc=exc)
