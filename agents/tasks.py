"""The agent's Celery app and its tasks: commands from the portal come here.

This is the agent's own app (the portal's lives in portal/celery.py); it
consumes only the queue ``node.<name>`` (set in agents/__main__.py). The
portal sends by name, e.g.::

    app.send_task("agent.launch", args=[job_id, attempt, spec], queue=f"node.{node}")
    app.send_task("agent.launches", args=[[[job_id, attempt, spec], ...]], queue=f"node.{node}")  # protocol 1.4
    app.send_task("agent.stop", args=[job_id, attempt, reason, grace_s(, signal)], queue=f"node.{node}")
    app.send_task("agent.probe", args=[nonce], queue=f"node.{node}")
    app.send_task("agent.prefetch", args=[datasets], queue=f"node.{node}")

Tasks are thin: they hand over to the process's ``Agent`` (``bind_agent``).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from celery import Celery

from agents.broker import CONNECTION_SETTINGS, guard_redis_channel_close
from agents.client import PortalUnreachable

log = logging.getLogger(__name__)

guard_redis_channel_close()  # a Redis restart must not crash the consumer (agents/broker.py)
app = Celery("gpuportal_agent")
app.conf.update(
    task_serializer="json",
    accept_content=["json"],  # a broker message must never unpickle into code
    task_ignore_result=True,  # facts go up through REST, not a result backend
    # Ack after the task ran: a launch lost to an agent crash is redelivered,
    # and fencing (confirm + one sandbox per attempt) makes the redelivery safe.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    **CONNECTION_SETTINGS,  # reconnect forever: a broker outage is waited out (agents/broker.py)
)

_agent = None


def bind_agent(agent) -> None:
    """Give the tasks the Agent of this process (the Celery pool must be in-process)."""
    global _agent
    _agent = agent


def _the_agent():
    if _agent is None:
        raise RuntimeError("agent tasks ran before bind_agent(): start the agent with python -m agents")
    return _agent


@app.task(name="agent.launch", autoretry_for=(PortalUnreachable,), retry_backoff=2, retry_backoff_max=30,
          max_retries=8)
def launch(job_id: str, attempt: int, spec: dict) -> str:
    return _the_agent().launch(job_id, attempt, spec)


# Launches of one agent.launches message that run side by side (each confirms with the portal, then
# starts its sandbox), as the worker's threads would run them sent one by one.
LAUNCH_THREADS = 8


@app.task(name="agent.launches", bind=True, max_retries=8)
def launches(self, items: list) -> list[str]:
    """A node's launches of one scheduling pass (protocol 1.4), each [job_id, attempt, spec] as
    `launch` takes it. Those the portal could not confirm are retried alone, with backoff as
    `launch`'s; a redelivered one that already runs here is a duplicate, a no-op."""
    agent = _the_agent()
    agent.expect_launches(min(len(items), LAUNCH_THREADS))  # their confirmations in one request
    with ThreadPoolExecutor(max_workers=max(1, min(len(items), LAUNCH_THREADS))) as pool:
        futures = [pool.submit(agent.launch, str(job_id), int(attempt), spec) for job_id, attempt, spec in items]
    results, again = [], []
    for item, future in zip(items, futures):
        try:
            results.append(future.result())
        except PortalUnreachable:
            again.append(item)
        except Exception:  # one launch's failure is its own: the others stand
            log.exception("launch of job %s attempt %s failed", item[0], item[1])
            results.append("failed")
    if again:
        raise self.retry(args=[again], countdown=min(30, 2 ** (self.request.retries + 1)))
    return results


@app.task(name="agent.probe", autoretry_for=(PortalUnreachable,), retry_backoff=2, retry_backoff_max=30,
          max_retries=8)
def probe(nonce: str) -> str:
    """Sent once at registration: answering it proves this agent receives its queue."""
    return _the_agent().answer_probe(nonce)


@app.task(name="agent.prefetch")
def prefetch(datasets: list) -> str:
    """Fetch datasets into this node's cache ahead of a job reserved here (launch-spec entries)."""
    return _the_agent().prefetch(datasets)


@app.task(name="agent.stop")
def stop(job_id: str, attempt: int, reason: str, grace_s: float, signal: str | None = None) -> bool:
    """With `signal` (a checkpointing job): send it, give the job `grace_s` to save, then stop it."""
    return _the_agent().stop(job_id, attempt, reason, grace_s, signal=signal)
