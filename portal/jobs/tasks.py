from celery import shared_task

from .node_effects import nodes_reap
from .notifications import job_notify


@shared_task(name="jobs.notify", bind=True, ignore_result=True, max_retries=5, default_retry_delay=60)
def notify(self, job_id: int, attempt: int, kind: str) -> bool:
    """Queued after commit by notifications.notify_on_commit; idempotent (NotificationSent)."""
    try:
        return job_notify(job_id=job_id, attempt=attempt, kind=kind)
    except OSError as exc:  # SMTP down or refusing (smtplib errors are OSErrors): try again later
        raise self.retry(exc=exc)


# Named for what it reaps: the name beat and the queue routes know (portal/celery.py), kept since
# the task moved here from portal/nodes/ with the jobs it requeues.
@shared_task(name="nodes.reap_nodes", ignore_result=True)
def reap_nodes() -> dict:
    """Every NODE_REAP_INTERVAL_S (beat): nodes silent past their deadline go down, their jobs back
    to the queue (node_effects.nodes_reap)."""
    return nodes_reap()
