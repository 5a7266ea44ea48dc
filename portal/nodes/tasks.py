from celery import shared_task


@shared_task(name="nodes.reap_nodes", ignore_result=True)
def reap_nodes() -> dict:
    from .services import nodes_reap

    return nodes_reap()
