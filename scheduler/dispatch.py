"""Commands down to node agents: `agent.launch` / `agent.stop` on the queue `node.<name>`.

Publishing is best effort: a lost launch is re-sent by a later scheduling pass and a lost
stop by the heartbeat answer (the portal tells the agent which attempts to stop).
"""
import contextvars
import logging
from contextlib import contextmanager

from celery.utils.nodenames import anon_nodename
from django.conf import settings
from kombu.utils.uuid import uuid

from portal.celery import app, node_queue

log = logging.getLogger(__name__)
# The publish function of a batch in progress (_batch), so _send keeps one simple signature.
_publisher: contextvars.ContextVar = contextvars.ContextVar("publisher", default=None)


def send_launch(node_name: str, job_id: int, attempt: int, spec: dict | None) -> None:
    send_launches([(node_name, job_id, attempt)], {(node_name, job_id): spec})


def send_launches(launches: list[tuple[str, int, int]], specs: dict[tuple[str, int], dict | None],
                  batched: frozenset[str] | set[str] = frozenset()) -> None:
    """Publish the launches of (node, job, attempt) triples with their specs by (node, job), as
    portal.launch.launch_specs reads them (this module imports no portal app: jobs and
    nodes publish through it, docs/design.md section 2). A node in `batched` (its agent speaks
    agents.protocol.LAUNCHES_SINCE) gets all of its launches in one `agent.launches` message;
    any other one `agent.launch` each."""
    if not launches:
        return
    per_node: dict[str, list] = {}
    for node_name, job_id, attempt in launches:
        spec = specs.get((node_name, job_id))
        if spec is None or spec["attempt"] != attempt:
            continue  # the job moved on before we published: nothing to launch
        per_node.setdefault(node_name, []).append([str(job_id), attempt, spec])
    try:
        with _batch():
            for node_name, items in per_node.items():
                if node_name in batched:
                    _send("agent.launches", node_name, [items],
                          argsrepr=repr([[job_id, attempt] for job_id, attempt, _ in items]))
                    continue
                for job_id, attempt, spec in items:
                    _send("agent.launch", node_name, [job_id, attempt, spec], argsrepr=f"['{job_id}', {attempt}, ...]")
    except Exception as exc:  # the broker is down: later passes re-send what was not confirmed
        log.warning("could not publish %d launches: %s", len(launches), exc)


@contextmanager
def _batch():
    """Within it, _send publishes through one broker connection and one pipeline (kombu's
    Producer.batch; a broker without pipelines publishes one by one), flushed at the end: a pass
    may start thousands of jobs, and a round trip each cost milliseconds.

    Each message is made by Celery's own protocol (app.amqp.as_task_v2) and published straight
    to the node's queue (the anonymous exchange, as send_task publishes to a direct queue):
    send_task's routing, options and configuration reads were two thirds of the CPU, for nothing
    a node queue needs. The queue is not declared (its agent declares it), and the args are shown
    as `argsrepr` says: rendering each spec cost as much again, and it holds the job's environment.
    """
    conf = app.conf
    make, origin = app.amqp.as_task_v2, anon_nodename()
    options = {"exchange": "", "serializer": conf.task_serializer, "compression": conf.task_compression,
               "delivery_mode": conf.task_default_delivery_mode, "retry": False, "declare": []}
    with app.producer_or_acquire() as producer, producer.batch():
        def publish(task: str, node_name: str, args: list, argsrepr: str) -> None:
            headers, properties, body, _ = make(uuid(), task, args, argsrepr=argsrepr, kwargsrepr="{}",
                                                origin=origin, ignore_result=None)
            producer.publish(body, routing_key=node_queue(node_name), headers=headers, **options, **properties)

        token = _publisher.set(publish)
        try:
            yield
        finally:
            _publisher.reset(token)


def send_stop(node_name: str, job_id: int, attempt: int, reason: str, grace_s: int | None = None,
              signal: str | None = None) -> None:
    """`agent.stop`: SIGTERM, `grace_s`, SIGKILL; with `signal` (a checkpointing job) that signal
    first and `grace_s` to save, then the agent's own stop."""
    grace = settings.PREEMPT_GRACE_S if grace_s is None else grace_s
    _send("agent.stop", node_name, [str(job_id), attempt, reason, grace] + ([signal] if signal else []))


def send_prefetch(node_name: str, entries: list[dict]) -> None:
    """`agent.prefetch`: fetch these datasets (launch-spec entries) into the node's cache ahead of a
    job the plan reserved it for."""
    _send("agent.prefetch", node_name, [entries])


def send_probe(node_name: str, nonce: str) -> None:
    """`agent.probe` on the node's queue: the agent answers with the nonce through the agent API,
    which proves it receives its queue (the node takes jobs only then)."""
    _send("agent.probe", node_name, [nonce])


def _send(task: str, node_name: str, args: list, **options) -> None:
    try:
        publish = _publisher.get()
        if publish is not None:
            publish(task, node_name, args, options["argsrepr"])
        else:
            app.send_task(task, args=args, queue=node_queue(node_name), retry=False, **options)
    except Exception as exc:  # an unreachable broker must not undo committed work
        log.warning("could not publish %s%s to %s: %s", task, args[:2], node_name, exc)
