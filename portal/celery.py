"""The portal's Celery app and its queues (docs/design.md section 1).

- `scheduler`: scheduler.schedule_pass, nodes.reap_nodes, billing.meter_usage, the metrics.* rollups,
  prune and idle-job flags, interactive.cull_sessions and autoscale.tick (task_routes below).
  Run by the portal's own workers; one scheduling pass at a time (advisory lock).
- `default`: everything else the portal queues (notifications, housekeeping).
- `node.<name>`: one queue per GPU node, consumed only by that node's agent
  (`agent.launch`, `agent.stop`). The portal only publishes there.
"""
import os

from celery import Celery
from celery.signals import task_prerun
from django.conf import settings
from django.db import close_old_connections
from kombu import Queue

from agents.broker import CONNECTION_SETTINGS, guard_redis_channel_close

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

guard_redis_channel_close()  # a Redis restart must not crash the worker (agents/broker.py)
app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(CONNECTION_SETTINGS)  # reconnect forever: a broker outage is waited out
# Celery's Django fixup closes every database connection around each task unless told to reuse
# them: a scheduling pass a few times a second then forked a PostgreSQL backend each time (its
# start, the time zone set again). Reused as a web request reuses them instead: closed once older
# than CONN_MAX_AGE or broken, checked before first use (DB_CONN_MAX_AGE, CONN_HEALTH_CHECKS).
app.conf.update(CELERY_DB_REUSE_MAX=1000)


@task_prerun.connect
def _reuse_connections(task=None, **kwargs):
    # Not for a task run eagerly (in the caller's process and transaction): its connection is the caller's.
    if not getattr(getattr(task, "request", None), "is_eager", False):
        close_old_connections()


app.conf.task_queues = (Queue("default"), Queue("scheduler"))
app.conf.task_routes = {
    "scheduler.*": {"queue": "scheduler"},
    "nodes.reap_nodes": {"queue": "scheduler"},
    "billing.*": {"queue": "scheduler"},
    "metrics.*": {"queue": "scheduler"},
    "interactive.*": {"queue": "scheduler"},
    "autoscale.*": {"queue": "scheduler"},
}
app.autodiscover_tasks(["portal.core", "portal.accounts", "portal.tenancy", "portal.nodes", "portal.jobs",
                        "portal.storage"])
app.autodiscover_tasks(["scheduler"], related_name="tasks")
app.autodiscover_tasks(["portal.interactive"])
app.autodiscover_tasks(["portal.billing", "portal.metrics", "portal.autoscale"])
app.conf.beat_schedule = {
    # Passes also run on submit, job end and node change; this catches everything else.
    "schedule-pass": {"task": "scheduler.schedule_pass", "schedule": 5.0, "options": {"queue": "scheduler"}},
    # Detection time of a dead node is NODE_TIMEOUT_S plus this period (portal/settings.py).
    "reap-nodes": {"task": "nodes.reap_nodes", "schedule": settings.NODE_REAP_INTERVAL_S,
                   "options": {"queue": "scheduler"}},
    # Upserted totals per (allocation, hour): a late or doubled run bills nothing twice.
    "meter-usage": {"task": "billing.meter_usage", "schedule": 60.0, "options": {"queue": "scheduler"}},
    "rollup-metrics-minute": {"task": "metrics.rollup_minute", "schedule": 60.0, "options": {"queue": "scheduler"}},
    "rollup-metrics-hour": {"task": "metrics.rollup_hour", "schedule": 300.0, "options": {"queue": "scheduler"}},
    "prune-metrics": {"task": "metrics.prune", "schedule": 3600.0, "options": {"queue": "scheduler"}},
    # Reads the minute rollups; flags (and, where a project asks, cancels) jobs idling on GPUs.
    "flag-idle-jobs": {"task": "metrics.flag_idle_jobs", "schedule": 60.0, "options": {"queue": "scheduler"}},
    # Interactive sessions: warn the idle, stop those idle past the grace or past their lifetime.
    "cull-sessions": {"task": "interactive.cull_sessions", "schedule": 60.0, "options": {"queue": "scheduler"}},
    # Dataset versions whose reading task was lost or whose reader died (docs/storage.md, "Datasets").
    "inspect-datasets": {"task": "storage.dataset_inspect_pending", "schedule": 300.0,
                         "options": {"queue": "default"}},
    # Artifacts past their project's retention (docs/storage.md, "Artifacts"); none with retention 0.
    "expire-artifacts": {"task": "storage.artifacts_expire", "schedule": 3600.0, "options": {"queue": "default"}},
    # Node pools: scale up for waiting work, release idle nodes (docs/autoscaling.md); a no-op without pools.
    "autoscale": {"task": "autoscale.tick", "schedule": settings.AUTOSCALE_INTERVAL_S,
                  "options": {"queue": "scheduler"}},
}


def node_queue(node_name: str) -> str:
    """The queue a node's agent consumes; the only place the naming rule lives."""
    return f"node.{node_name}"
