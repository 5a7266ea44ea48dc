from celery import shared_task

from .services import nodes_reap


@shared_task(name="nodes.reap_nodes", ignore_result=True)
def reap_nodes() -> dict:
    return nodes_reap()
