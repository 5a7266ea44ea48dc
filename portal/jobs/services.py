"""Writes for jobs: submit, cancel, resubmit, templates. Views, the API and the CLI call these."""
import hashlib
import json
import threading

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from rest_framework import serializers

from portal.core import locks
from portal.core.context import Actor
from portal.core.errors import Conflict, Forbidden, InvalidInput, ServiceError, Unprocessable, check_valid
from portal.core.queue import request_schedule_pass
from portal.core.plainsql import insert
from portal.core.services import audit_record, require_operator
from portal.core.text import check_plain_name
from portal.tenancy.access import check_token_project, user_can
from portal.tenancy.models import Project
from portal.tenancy.selectors import project_for_submit
from scheduler.dispatch import send_stop

from . import submit_hooks
from .models import CANCELLABLE, HOLDING, QOS_VALUE, TERMINAL, Job, JobEvent, JobState, JobTemplate
from .selectors import gpu_hours_used_this_month
from .spec import JobSpecSerializer, ResourcesSerializer, _cluster_fit, parse_array
from .states import requeue_holding, transition

SPEC_FIELDS = ("name", "image", "command", "env", "resources", "time_limit", "priority", "preemptible", "sandbox",
               "network", "array", "depends_on", "checkpoint", "do_not_disrupt")


def _submit_project(actor: Actor, slug) -> Project:
    if not isinstance(slug, str) or not slug:
        raise InvalidInput("This field is required.", field="project")
    if "\x00" in slug:  # PostgreSQL cannot compare one: refused before the lookup
        raise InvalidInput("Null characters are not allowed.", field="project")
    # One query: the project as the caller sees it, and whether their role lets them submit there.
    project = project_for_submit(actor.user, slug, project_id=actor.restricted_project_id)
    if project is None:
        raise InvalidInput(f"No project named {slug!r}.", field="project")
    if not project.may_submit:
        raise Forbidden(f"Your role in {slug} does not allow submitting jobs.", field="project")
    return project


def _submit_project_or_all_errors(actor: Actor, data: dict) -> Project:
    """_submit_project, whose refusal comes with the rest of the request's field errors (the
    quota rules need a project; the other checks do not)."""
    try:
        return _submit_project(actor, data.get("project"))
    except InvalidInput as exc:
        check = JobSpecSerializer(data=data, context={"project": None})
        errors = {} if check.is_valid() else dict(check.errors)
        errors.pop("project", None)
        if not errors:
            raise
        raise InvalidInput.from_detail({**exc.as_fields(), **errors}) from None


def merge_template(project: Project, data: dict) -> tuple[dict, JobTemplate | None]:
    """The template's spec under the submitted fields; locked fields may not differ."""
    name = data.get("template")
    if not name:
        return data, None
    template = JobTemplate.objects.filter(project=project, name=name).first()
    if template is None:
        raise InvalidInput(f"No template named {name!r} in {project.slug}.", field="template")
    merged = {**template.spec, **data}
    for field in template.locked:
        if field in data and data[field] != template.spec.get(field):
            raise InvalidInput(f"Locked by template {name}; it cannot be overridden.", field=field)
    return merged, template


def job_submit(*, actor: Actor, data: dict, idempotency_key: str = "") -> tuple[Job, bool]:
    """Validate a spec and store the job (or an array parent and its tasks) in one transaction.

    Returns (job, created). With an idempotency key this caller already used for the same
    request, returns the job it created and created=False, storing nothing; the key used for
    any other request is refused (422). A refused submit stores nothing.
    """
    if not isinstance(data, dict):
        raise InvalidInput("Expected a JSON object.")
    fingerprint = _idempotency_fingerprint(actor, data) if idempotency_key else ""
    if idempotency_key and (existing := _idempotent_replay(actor, idempotency_key, fingerprint)) is not None:
        return existing, False
    project = _submit_project_or_all_errors(actor, data)
    merged, template = merge_template(project, data)
    v = _checked_spec(merged, project)
    res = v["resources"]
    if res["gpus"] > 0:
        _check_budget(project)
    try:
        with transaction.atomic():
            deps = _dependencies(project, v["depends_on"])
            common = job_fields(actor, project, v, template)
            # An array parent is never scheduled itself: its tasks carry the reasons.
            job = Job(**common, array=v["array"], is_array_parent=bool(v["array"]),
                      idempotency_key=idempotency_key, idempotency_fingerprint=fingerprint,
                      reason_code="" if v["array"] else "new",
                      reason_message="" if v["array"] else "Waiting for the scheduler's next pass.")
            insert(job)
            if deps:  # a new job has none to replace: no query for the common case
                job.depends_on.set(deps)
            _dependencies_known(job, deps)
            for created in submit_hooks.on_create.values():  # the sessions of its ports (interactive)
                created(job, v)
            if v["array"]:
                indexes, limit = parse_array(v["array"])
                job.array_limit = limit
                job.save(update_fields=["array_limit"])
                tasks = Job.objects.bulk_create([
                    Job(**common, array_parent=job, array_index=i, array_limit=limit, reason_code="new",
                        reason_message="Waiting for the scheduler's next pass.")
                    for i in indexes
                ])
                through = Job.depends_on.through
                through.objects.bulk_create([through(from_job_id=t.pk, to_job_id=d.pk) for t in tasks for d in deps])
            audit_record(actor=actor, action="job.submit", obj=job, project=project,
                         gpus=str(res["gpus"]), array=v["array"])
    except IntegrityError:
        # The same idempotency key raced us: return the winner's job (if it was this request).
        if idempotency_key and (existing := _idempotent_replay(actor, idempotency_key, fingerprint)) is not None:
            return existing, False
        raise
    request_schedule_pass()
    return job, True


# One JobSpecSerializer a thread, for `_checked_spec`.
_spec_checkers = threading.local()


def _checked_spec(data: dict, project: Project) -> dict:
    """check_valid(JobSpecSerializer(data=data, context={"project": project})). A serializer made
    for each submit deep-copies and binds its declared fields (most of what checking a spec
    costs); a spec is checked by one instance a thread instead, whose context is this submit's
    while it checks (its fields keep no state between calls; their defaults are callables, so
    fresh). A refused spec is checked again by a fresh serializer, so its 400 is DRF's own
    (tests/jobs/test_submit_errors.py)."""
    checker = getattr(_spec_checkers, "serializer", None)
    if checker is None:
        checker = _spec_checkers.serializer = JobSpecSerializer()
        checker.fields  # bound once
    if type(data) is dict:
        checker._context = {"project": project}
        try:
            return checker.run_validation(data)
        except serializers.ValidationError:
            pass
        finally:
            checker._context = {}
    return check_valid(JobSpecSerializer(data=data, context={"project": project}))


def _dependencies_known(job: Job, deps: list[Job]) -> None:
    """Let `job.depends_on.all()` answer `deps` without a query, as prefetch_related("depends_on")
    would: the submit's answer is serialized from the job just stored, not read back."""
    # none() when there are none (most submits): cheaper to build than a filter, and as right for
    # anything chained onto it.
    known = Job.objects.filter(pk__in=[d.pk for d in deps]) if deps else Job.objects.none()
    known._result_cache, known._prefetch_done = list(deps), True
    job._prefetched_objects_cache = {"depends_on": known}


def job_fields(actor: Actor, project: Project, v: dict, template: JobTemplate | None) -> dict:
    """A new Job's fields from a checked spec (JobSpecSerializer's validated data)."""
    res = v["resources"]
    return dict(
        project=project, user=actor.user, name=v["name"], image=v["image"], command=v["command"],
        env=v["env"], gpus=res["gpus"], nodes=res["nodes"], gpu_type=res["gpu_type"],
        gpu_memory_mb=res["gpu_memory_mb"], cpus=res["cpus"], memory_mb=res["memory_mb"],
        time_limit_s=v["time_limit"], priority=v["priority"], preemptible=v["preemptible"],
        sandbox=v["sandbox"], network=v["network"], template=template, volumes=v["volumes"],
        datasets=v.get("datasets") or [],
        checkpoint_signal=(v["checkpoint"] or {}).get("signal", ""),
        checkpoint_grace_s=(v["checkpoint"] or {}).get("grace_s"),
        checkpoint_interval_s=(v["checkpoint"] or {}).get("interval_s"),
        do_not_disrupt=v.get("do_not_disrupt", False),
    )


def _check_budget(project: Project) -> None:
    """A GPU job is refused (409) once the project's GPU-hours this month reach its budget."""
    quota = project.quota
    if quota.gpu_hours_budget is None:
        return
    used = gpu_hours_used_this_month([project.pk]).get(project.pk, 0.0)
    if used >= float(quota.gpu_hours_budget):
        raise Conflict(f"The project's GPU-hour budget is spent: {used:.1f} of {quota.gpu_hours_budget} "
                       "GPU-hours this month. Ask an owner to raise it.", code="budget_exhausted")


# What the jobs of a batch (a sweep) usually differ in: checked one by one, field by field, so the
# rest of their spec is checked once. No rule across fields reads them.
PER_JOB_FIELDS = ("name", "env")


def _check_field(serializer: JobSpecSerializer, field: str, value):
    """One spec field checked as the whole spec would check it (the field, then validate_<field>)."""
    try:
        value = serializer.fields[field].run_validation(value)
        if (check := getattr(serializer, f"validate_{field}", None)) is not None:
            value = check(value)
    except serializers.ValidationError as exc:  # the serializer's own check of one field
        raise InvalidInput.from_detail({field: exc.detail}) from None
    return value


def job_submit_batch(*, actor: Actor, data) -> list[int]:
    """Submit many jobs in one request, all or nothing; returns their ids in the given order.

    `data` is {"jobs": [spec, ...], "defaults": {spec fields}}: each job is `defaults` under its
    own fields, checked as a single submit would be (project, role, template, quota rules, budget).
    Any refusal refuses the whole batch (400 naming `jobs[i].field`) and stores nothing. Jobs
    that differ only in their name and environment are checked once. Plain jobs are stored with one bulk insert;
    a batch holding an array, a dependency or a session port stores its jobs one by one.
    """
    if not isinstance(data, dict):
        raise InvalidInput("Expected a JSON object.")
    defaults, specs = data.get("defaults", {}), data.get("jobs")
    if not isinstance(defaults, dict):
        raise InvalidInput("Expected a JSON object of spec fields.", field="defaults")
    if not isinstance(specs, list) or not specs:
        raise InvalidInput("Expected a list of at least one job spec.", field="jobs")
    if len(specs) > settings.JOB_BATCH_MAX_JOBS:
        raise InvalidInput(f"At most {settings.JOB_BATCH_MAX_JOBS} jobs in one request.", field="jobs")
    projects: dict[str, Project] = {}
    # Distinct specs (without their name) per project, each checked once, by one list serializer
    # per project: building a serializer costs more than checking a spec.
    distinct: dict[int, dict[str, tuple[dict, list[int]]]] = {}
    parsed: list[tuple | None] = []  # per job: (project, template, spec key, name)
    errors: dict[str, list] = {}
    for i, item in enumerate(specs):
        parsed.append(None)
        if not isinstance(item, dict):
            errors[f"jobs[{i}]"] = ["Expected a JSON object."]
            continue
        try:
            slug = {**defaults, **item}.get("project")
            if not isinstance(slug, str) or slug not in projects:
                projects[slug] = _submit_project(actor, slug)  # InvalidInput for a bad or unknown slug
            project = projects[slug]
            merged, template = merge_template(project, {**defaults, **item})
        except InvalidInput as exc:
            errors.update({f"jobs[{i}].{k}": msgs for k, msgs in exc.as_fields().items()} or
                          {f"jobs[{i}]": [exc.message]})
            continue
        own = {f: merged.pop(f) for f in PER_JOB_FIELDS if f in merged}
        key = json.dumps(merged, sort_keys=True, default=str)
        distinct.setdefault(project.pk, {}).setdefault(key, (merged, []))[1].append(i)
        parsed[i] = (project, template, key, own)
    checked: dict[tuple[int, str], dict] = {}
    gpu_sizes: dict = {}  # the cluster's node sizes, read once for the whole batch
    for project_pk, by_key in distinct.items():
        keys = list(by_key)
        spec = JobSpecSerializer(data=[by_key[k][0] for k in keys], many=True,
                                 context={"project": next(p for p in projects.values() if p.pk == project_pk),
                                          "gpu_sizes": gpu_sizes})
        if spec.is_valid():
            checked.update({(project_pk, k): v for k, v in zip(keys, spec.validated_data)})
            continue
        found = spec.errors
        for n, detail in (found.items() if isinstance(found, dict) else enumerate(found)):
            if not isinstance(detail, dict):
                continue  # a spec with no errors of its own
            for i in by_key[keys[int(n)]][1]:
                errors.update({f"jobs[{i}].{field}": msgs for field, msgs in detail.items()})
    fields_of = JobSpecSerializer()
    items = []
    for i, entry in enumerate(parsed):
        if entry is None:
            continue
        project, template, key, own = entry
        try:
            own = {f: _check_field(fields_of, f, value) for f, value in own.items()}
        except InvalidInput as exc:
            errors.update({f"jobs[{i}].{f}": msgs for f, msgs in exc.as_fields().items()})
            continue
        if (project.pk, key) in checked:
            items.append((project, {**checked[(project.pk, key)], **own}, template))
    if errors:
        raise InvalidInput.from_detail(errors)
    for project in {p.pk: p for p, v, _ in items if v["resources"]["gpus"] > 0}.values():
        _check_budget(project)
    plain = all(not (v["array"] or v["depends_on"] or v.get("ports")) for _, v, _ in items)
    with transaction.atomic():
        if plain:
            jobs = Job.objects.bulk_create([
                Job(**job_fields(actor, project, v, template), reason_code="new",
                    reason_message="Waiting for the scheduler's next pass.") for project, v, template in items],
                batch_size=2000)
        else:
            jobs = [job_submit(actor=actor, data={**defaults, **item})[0] for item in specs]
        by_project: dict[int, list[Job]] = {}
        for job in jobs:
            by_project.setdefault(job.project_id, []).append(job)
        for mine in by_project.values():
            audit_record(actor=actor, action="job.submit_batch", obj=mine[0], project=mine[0].project,
                         jobs=len(mine), first=mine[0].pk, last=mine[-1].pk)
    request_schedule_pass()
    return [job.pk for job in jobs]


def job_spec_check(*, actor: Actor, data: dict) -> None:
    """Raise what a submit of `data` would raise about its fields, storing nothing (the submit
    page asks when its own checks failed, so one answer lists every problem)."""
    project = _submit_project_or_all_errors(actor, data)
    merged, _ = merge_template(project, data)
    check_valid(JobSpecSerializer(data=merged, context={"project": project}))


def _idempotency_fingerprint(actor: Actor, data: dict) -> str:
    """What an Idempotency-Key is bound to: the request body, serialised canonically (key order
    and spacing do not matter), and the token's project restriction, so a key is scoped to the
    caller (keys are per user already) and one request."""
    canonical = json.dumps({"body": data, "restricted_project": actor.restricted_project_id}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _idempotent_replay(actor: Actor, key: str, fingerprint: str) -> Job | None:
    """The job this caller's key created for this very request, None for a fresh key.

    As the IETF Idempotency-Key draft and Stripe do, a key reused with another body (or from a
    token restricted elsewhere, or for a job the caller can no longer see) is refused: answering
    with the first job would hide that the new request was never carried out.
    """
    existing = Job.objects.filter(user=actor.user, idempotency_key=key).first()
    if existing is None:
        return None
    visible = Job.objects.for_user(actor.user, "view", project_id=actor.restricted_project_id).filter(pk=existing.pk)
    if existing.idempotency_fingerprint != fingerprint or not visible.exists():
        raise Unprocessable("This Idempotency-Key was already used with a different request; send the same "
                            "request to get its job, or use a new key.", field="Idempotency-Key",
                            code="idempotency_key_reused")
    return existing


def _dependencies(project: Project, ids: list[int]) -> list[Job]:
    if not ids:
        return []
    found = {j.pk: j for j in Job.objects.filter(pk__in=ids, project=project)}
    missing = [i for i in ids if i not in found]
    if missing:
        raise InvalidInput(f"No job {missing[0]} in project {project.slug}.", field="depends_on")
    for job in found.values():
        if job.state in TERMINAL and job.state != JobState.SUCCEEDED:
            raise InvalidInput(f"Job {job.pk} already ended {job.state}; this job could never start.",
                               field="depends_on")
    # A new job cannot close a cycle (it has no dependents yet); an existing graph is acyclic by induction.
    return list(found.values())


def job_cancel(*, actor: Actor, job: Job, reason: str = "") -> Job:
    """Cancel a job (or every unfinished task of an array). Holders get a stop command."""
    check_token_project(actor, job.project)
    own = job.user_id == getattr(actor.user, "pk", None) and user_can(actor.user, "submit", job.project)
    if not actor.is_system and not own and not user_can(actor.user, "manage", job.project):
        raise Forbidden("You can cancel your own jobs; project owners and admins can cancel any.")
    targets = list(job.tasks.filter(state__in=CANCELLABLE)) if job.is_array_parent else [job]
    if not job.is_array_parent and job.state not in CANCELLABLE:
        raise Conflict(f"Job {job.pk} is {job.state} and cannot be cancelled.", code="not_cancellable")
    if job.is_array_parent and not targets and job.state in TERMINAL:
        raise Conflict(f"Array job {job.pk} has already ended.", code="not_cancellable")
    message = reason or f"Cancelled by {actor.user.get_username() if actor.user else actor.label}."
    stops = []
    with transaction.atomic():
        for target in targets:
            held = Job.objects.filter(pk=target.pk).values("state", "attempt", "node__name").first()
            if transition(target.pk, to=JobState.CANCELLED, from_states=CANCELLABLE, message=message,
                          reason_code="cancelled", reason_message=message):
                if held["state"] in HOLDING and held["node__name"]:
                    stops.append((held["node__name"], target.pk, held["attempt"]))
        if job.is_array_parent:
            transition(job.pk, to=JobState.CANCELLED, from_states=set(JobState.values) - TERMINAL, message=message)
        audit_record(actor=actor, action="job.cancel", obj=job, project=job.project)
        _send_stops_on_commit(stops, "cancelled")
    request_schedule_pass()
    job.refresh_from_db()
    return job


def jobs_cancel(*, actor: Actor, jobs) -> tuple[list[int], list[str]]:
    """Cancel each of `jobs` (the page's bulk cancel): (ids cancelled, one refusal per job that
    could not be, saying why). Each job is its own transaction, so one refusal stops no other."""
    done, refusals = [], []
    for job in jobs:
        try:
            job_cancel(actor=actor, job=job)
            done.append(job.pk)
        except ServiceError as exc:
            refusals.append(f"Job {job.pk}: {exc.message}")
    return done, refusals


def _send_stops_on_commit(stops, reason: str, grace_s: int | None = None):
    for node_name, job_id, attempt in stops:
        transaction.on_commit(lambda n=node_name, j=job_id, a=attempt: send_stop(n, j, a, reason, grace_s))


def job_move(*, actor: Actor, job: Job) -> Job:
    """Move a running job elsewhere (operators only): it goes back to the queue as its next attempt
    and its current one is stopped; a checkpointing job first gets its signal and grace to save and
    resumes from its checkpoint on whatever node the scheduler picks, any other job restarts."""
    require_operator(actor, "Only site staff move jobs.")
    if job.state not in HOLDING:
        raise Conflict(f"Job {job.pk} is {job.state}; only a job that holds GPUs can be moved.", code="not_running")
    who = actor.user.get_username() if actor.user else actor.label
    how = "to resume from its checkpoint" if job.checkpoint_signal else "to restart (it does not checkpoint)"
    with transaction.atomic():
        stops = requeue_holding(job.pk, attempt=job.attempt, reason_code="moved",
                                message=f"Moved by {who} {how}.")
        if stops is None:
            raise Conflict(f"Job {job.pk} changed state meanwhile; try again.", code="not_running")
        for name, job_id, attempt, grace, signal in stops:
            transaction.on_commit(lambda n=name, j=job_id, a=attempt, g=grace, s=signal:
                                  send_stop(n, j, a, "moved", g, s))
        audit_record(actor=actor, action="job.move", obj=job, project=job.project)
    request_schedule_pass()
    job.refresh_from_db()
    return job


def job_resubmit(*, actor: Actor, job: Job) -> Job:
    """A new job with the original's spec, linked to it (the original is left as it ended)."""
    data = {
        "project": job.project.slug, "name": job.name, "image": job.image, "command": job.command, "env": job.env,
        "resources": {"gpus": str(job.gpus), "nodes": job.nodes, "gpu_type": job.gpu_type,
                      "gpu_memory_mb": job.gpu_memory_mb, "cpus": str(job.cpus), "memory_mb": job.memory_mb},
        "time_limit": job.time_limit_s, "priority": job.priority, "preemptible": job.preemptible,
        "do_not_disrupt": job.do_not_disrupt,
        "sandbox": job.sandbox, "network": job.network, "array": job.array, "volumes": job.volumes,
        "checkpoint": job.checkpoint,
        "datasets": [f"{d['name']}@{d['version']}" for d in job.datasets or []],  # the same versions again
    }
    if job.array_parent_id:
        raise InvalidInput("Resubmit the array job, not one of its tasks.", code="array_task")
    if not env_kept_on_resubmit(actor, job):
        data["env"] = {}
    new, _ = job_submit(actor=actor, data=data)
    Job.objects.filter(pk=new.pk).update(resubmit_of=job)
    new.resubmit_of = job
    return new


def env_kept_on_resubmit(actor: Actor, job: Job) -> bool:
    """A job's environment often holds its owner's secrets: a resubmit by anyone else (a project
    admin included) runs without it rather than with someone else's credentials."""
    return actor.user is not None and actor.user.pk == job.user_id


def _check_may_control(actor: Actor, job: Job, verb: str) -> bool:
    """Who may hold, release or update a job: as for cancel, its submitter or the project's
    owners and admins. Returns whether the caller manages the project (may raise limits)."""
    check_token_project(actor, job.project)
    manages = actor.is_system or user_can(actor.user, "manage", job.project)
    own = job.user_id == getattr(actor.user, "pk", None) and user_can(actor.user, "submit", job.project)
    if not own and not manages:
        raise Forbidden(f"You can {verb} your own jobs; project owners and admins can {verb} any.")
    return manages


def _queued_targets(job: Job, verb: str) -> list[int]:
    """The rows a hold, release or update acts on: a queued job, or an array's queued tasks and
    its parent. Anything already placed or ended is refused: only the queue can be changed."""
    if job.is_array_parent:
        if job.state in TERMINAL:
            raise Conflict(f"Array job {job.pk} has already ended.", code="not_queued")
        return [job.pk, *job.tasks.filter(state=JobState.QUEUED).values_list("pk", flat=True)]
    if job.state != JobState.QUEUED:
        raise Conflict(f"Job {job.pk} is {job.state}: only a queued job can be {verb}.", code="not_queued")
    return [job.pk]


def _stop_scheduling_meanwhile() -> None:
    """Wait for a running scheduling pass to end and keep the next out until this transaction
    commits: a pass that took its snapshot before the change must not start the old job."""
    locks.xact_lock(locks.SCHEDULE_PASS)


def job_hold(*, actor: Actor, job: Job) -> Job:
    """Hold a queued job (Slurm's `scontrol hold`): it stays queued, reason `held`, and the
    scheduler passes it over until it is released. An array: its queued tasks."""
    _check_may_control(actor, job, "hold")
    who = actor.user.get_username() if actor.user else actor.label
    message = f"Held by {who}; release it to let it start."
    with transaction.atomic():
        _stop_scheduling_meanwhile()
        job.refresh_from_db()
        targets = _queued_targets(job, "held")
        Job.objects.filter(pk__in=targets).exclude(pk=job.pk, is_array_parent=True).filter(
            state=JobState.QUEUED).update(held=True, reason_code="held", reason_message=message, queue_position=None)
        Job.objects.filter(pk=job.pk).update(held=True)
        JobEvent.objects.create(job=job, attempt=job.attempt, state=job.state, message=message)
        audit_record(actor=actor, action="job.hold", obj=job, project=job.project, jobs=len(targets))
    job.refresh_from_db()
    return job


def job_release(*, actor: Actor, job: Job) -> Job:
    """Let a held job be scheduled again (Slurm's `scontrol release`); it keeps its submit time."""
    _check_may_control(actor, job, "release")
    who = actor.user.get_username() if actor.user else actor.label
    with transaction.atomic():
        job.refresh_from_db()
        targets = _queued_targets(job, "released")
        if not job.held and not Job.objects.filter(pk__in=targets, held=True).exists():
            raise Conflict(f"Job {job.pk} is not held.", code="not_held")
        Job.objects.filter(pk__in=targets, held=True).exclude(pk=job.pk, is_array_parent=True).update(
            held=False, reason_code="new", reason_message="Released; waiting for the scheduler's next pass.")
        Job.objects.filter(pk=job.pk).update(held=False)
        JobEvent.objects.create(job=job, attempt=job.attempt, state=job.state, message=f"Released by {who}.")
        audit_record(actor=actor, action="job.release", obj=job, project=job.project, jobs=len(targets))
    request_schedule_pass()
    job.refresh_from_db()
    return job


def job_update(*, actor: Actor, job: Job, time_limit: int | None = None, priority: str | None = None,
               gpus=None) -> Job:
    """Change a queued job (Slurm's `scontrol update`): its time limit, QoS priority or GPU count.

    Its submitter may lower the time limit and priority and change the GPU count within the
    project's limits; raising the time limit or priority takes the project's owner or admin
    role. Every refused field is reported at once; a refused update changes nothing.
    """
    manages = _check_may_control(actor, job, "update")
    quota = job.project.quota
    errors: dict[str, list[str]] = {}
    changes: dict = {}
    if time_limit is not None:
        if time_limit > quota.max_time_limit_s:
            errors["time_limit"] = [f"{time_limit} s exceeds the project maximum of {quota.max_time_limit_s} s."]
        elif time_limit > job.time_limit_s and not manages:
            errors["time_limit"] = [f"You may lower the time limit ({job.time_limit_s} s) but not raise it; "
                                    "ask a project owner or admin."]
        changes["time_limit_s"] = time_limit
    if priority is not None:
        if QOS_VALUE[priority] > QOS_VALUE[job.priority] and not manages:
            errors["priority"] = [f"You may lower the priority ({job.priority}) but not raise it; "
                                  "ask a project owner or admin."]
        changes["priority"] = priority
    if gpus is not None:
        res = ResourcesSerializer(data={
            "gpus": str(gpus), "nodes": job.nodes, "gpu_type": job.gpu_type, "cpus": str(job.cpus),
            "memory_mb": job.memory_mb, "gpu_memory_mb": job.gpu_memory_mb if 0 < gpus < 1 else 0})
        if not res.is_valid():
            errors.update({f"resources.{k}": v for k, v in res.errors.items()})
        elif gpus > quota.max_gpus:
            errors["resources.gpus"] = [f"{gpus.normalize()} exceeds the project limit of "
                                        f"{quota.max_gpus.normalize()}."]
        else:
            if gpus >= 1:
                errors.update(_cluster_fit(res.validated_data))
            changes.update(gpus=gpus, gpu_memory_mb=res.validated_data["gpu_memory_mb"])
    if errors:
        raise InvalidInput.from_detail(errors)
    if not changes:
        raise InvalidInput("Nothing to change: give a new time_limit, priority or resources.gpus.",
                           code="nothing_to_update")
    who = actor.user.get_username() if actor.user else actor.label
    said = ", ".join(f"{k.removesuffix('_s')} {job_value_text(v)}" for k, v in changes.items()
                     if k != "gpu_memory_mb")
    with transaction.atomic():
        _stop_scheduling_meanwhile()
        job.refresh_from_db()
        targets = _queued_targets(job, "updated")
        # Conditional: a task placed since the check above keeps what it was placed with.
        Job.objects.filter(pk__in=targets).filter(Q(state=JobState.QUEUED) | Q(is_array_parent=True)).update(
            **changes)
        JobEvent.objects.create(job=job, attempt=job.attempt, state=job.state, message=f"Updated by {who}: {said}.")
        audit_record(actor=actor, action="job.update", obj=job, project=job.project,
                     **{k: job_value_text(v) for k, v in changes.items()})
    request_schedule_pass()
    job.refresh_from_db()
    return job


def job_value_text(value) -> str:
    return str(value.normalize()) if hasattr(value, "normalize") else str(value)


def template_save(*, actor: Actor, project: Project, name: str, spec: dict, locked: list[str],
                  description: str = "", template: JobTemplate | None = None) -> JobTemplate:
    check_token_project(actor, project)
    if not user_can(actor.user, "manage", project):
        raise Forbidden(f"You need the owner or admin role in {project.slug} to manage templates.")
    check_plain_name(name)
    unknown = [f for f in list(spec) + list(locked) if f not in SPEC_FIELDS]
    if unknown:
        raise InvalidInput(f"{unknown[0]!r} is not a job spec field.", field="spec" if unknown[0] in spec else "locked")
    # A template must itself be a valid spec fragment: check it with a placeholder name/command.
    probe = {"project": project.slug, "name": "template-check", "image": "x", "command": ["true"], **spec}
    check = JobSpecSerializer(data=probe, context={"project": project})
    if not check.is_valid():
        errors = {f"spec.{k}": v for k, v in check.errors.items() if k.split(".")[0] in spec}
        if errors:
            raise InvalidInput.from_detail(errors)
    with transaction.atomic():
        if template is None:
            if JobTemplate.objects.filter(project=project, name=name).exists():
                raise InvalidInput(f"A template named {name!r} already exists.", field="name")
            template = JobTemplate.objects.create(project=project, name=name, spec=spec, locked=locked,
                                                  description=description, created_by=actor.user)
        else:
            template.name, template.spec, template.locked, template.description = name, spec, locked, description
            template.save()
        audit_record(actor=actor, action="jobtemplate.save", obj=template, project=project)
    return template


def template_delete(*, actor: Actor, template: JobTemplate) -> None:
    check_token_project(actor, template.project)
    if not user_can(actor.user, "manage", template.project):
        raise Forbidden(f"You need the owner or admin role in {template.project.slug} to manage templates.")
    with transaction.atomic():
        audit_record(actor=actor, action="jobtemplate.delete", obj=template, project=template.project)
        template.delete()


