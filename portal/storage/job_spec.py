"""Storage's part of a job spec's checks: the volumes and datasets it names.

Registered in `portal/storage/apps.py` with `portal/jobs/submit_hooks.py`, which
JobSpecSerializer.project_rules runs: jobs sits below storage and imports none of this.
"""
from .datasets import resolve_job_datasets
from .selectors import project_volume_names


def job_spec_errors(project, data: dict) -> dict[str, list[str]]:
    """Field errors for the spec's volumes and datasets; resolves `data["datasets"]` from names
    ("imagenet@3", "tiny") to the versions the job will mount."""
    errors = volume_errors(project, data.get("volumes") or [], data.get("sandbox"))
    if data.get("datasets") and isinstance(data["datasets"][0], str):
        data["datasets"], dataset_errors = resolve_job_datasets(project, data["datasets"], data.get("sandbox"))
        errors.update(dataset_errors)
    return errors


def volume_errors(project, mounts: list[dict], sandbox: str | None) -> dict[str, list[str]]:
    """Each named volume must be one of the project's, named once (every sandbox mounts them)."""
    if not mounts:
        return {}
    known = project_volume_names(project)
    errors: dict[str, list[str]] = {}
    seen = set()
    for index, mount in enumerate(mounts):
        if mount["name"] not in known:
            errors[f"volumes.{index}.name"] = [f"Project {project.slug} has no volume named {mount['name']!r}."]
        elif mount["name"] in seen:
            errors[f"volumes.{index}.name"] = [f"Volume {mount['name']!r} is named twice."]
        seen.add(mount["name"])
    return errors
