from celery import shared_task


@shared_task(name="storage.dataset_inspect", ignore_result=True)
def dataset_inspect(version_id: int) -> str:
    """Read a new dataset version's source: its files, size and digest (portal/storage/datasets.py)."""
    from .datasets import dataset_version_inspect

    version = dataset_version_inspect(version_id)
    return version.state if version is not None else "gone"
