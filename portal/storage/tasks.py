from celery import shared_task

from .artifacts import artifacts_expire as expire_artifacts
from .datasets import dataset_inspect_pending as inspect_pending_versions
from .datasets import dataset_version_inspect


@shared_task(name="storage.dataset_inspect", ignore_result=True)
def dataset_inspect(version_id: int) -> str:
    """Read a new dataset version's source: its files, size and digest (portal/storage/datasets.py)."""
    version = dataset_version_inspect(version_id)
    return version.state if version is not None else "not pending, or being read"


@shared_task(name="storage.dataset_inspect_pending", ignore_result=True)
def dataset_inspect_pending() -> int:
    """Beat: read the pending dataset versions whose own task never ran or whose reader died."""
    return inspect_pending_versions()


@shared_task(name="storage.artifacts_expire", ignore_result=True)
def artifacts_expire() -> dict:
    """Beat: delete the artifacts past their project's retention (portal/storage/artifacts.py)."""
    return expire_artifacts()
