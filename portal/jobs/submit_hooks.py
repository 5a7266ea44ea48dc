"""What the apps above jobs add to a submit: registered by them here, never imported by jobs.

A job spec names things that belong to apps above jobs in the layers (docs/design.md section 2):
volumes and datasets (storage checks the names and pins each dataset's version) and published
ports (interactive makes them the job's sessions). Jobs runs what is registered here and imports
neither app. Each registers in its AppConfig.ready, so every process that has run django.setup()
has all of them:

- `portal/storage/apps.py`: the spec checks of volumes and datasets (`portal/storage/job_spec.py`);
- `portal/interactive/apps.py`: the sessions of a new job's ports (`interactive.services`).

`tests/jobs/test_submit_hooks.py` asserts that both are registered, so a dropped registration
fails CI rather than letting an unknown volume through.
"""
from collections.abc import Callable

# check(project, data) -> {field: [messages]}, run by JobSpecSerializer.project_rules on the fields
# that passed their own checks. It may replace a field of `data` with its resolved form (a
# dataset's "name@version" with the version it pins).
SpecCheck = Callable[[object, dict], dict[str, list[str]]]
# created(job, spec): run by job_submit inside its transaction once the job row is stored, with
# the checked spec; a refusal raised here rolls the whole submit back.
OnCreate = Callable[[object, dict], None]

# Keyed by the registering app's label, so a second ready() replaces rather than repeats.
spec_checks: dict[str, SpecCheck] = {}
on_create: dict[str, OnCreate] = {}


def register(app_label: str, *, spec_check: SpecCheck | None = None, created: OnCreate | None = None) -> None:
    """Called from an app's AppConfig.ready with what that app adds to every submit."""
    if spec_check is not None:
        spec_checks[app_label] = spec_check
    if created is not None:
        on_create[app_label] = created
