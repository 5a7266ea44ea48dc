"""Job pages: list, submit, detail with its live parts, and the cancel/resubmit buttons.

Each view loads rows through `Job.objects.for_user` (an outsider gets 404), calls one
service and renders. htmx polls ask for fragments and carry the version of what they
show; an unchanged fragment is answered with 204 so nothing on the page moves.
"""
import dataclasses
import datetime

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.views import View

from portal.core.errors import ServiceError, check_valid
from portal.core.numbers import parse_int, parse_ints
from portal.core.pages import PageMixin, refused, scoped_or_404, version
from portal.tenancy.access import user_can
from portal.tenancy.models import Project
from portal.tenancy.selectors import artifact_retention_days

from .api import JobUpdateSerializer
from .forms import JobFilterForm, JobSubmitForm
from .models import CANCELLABLE, HOLDING, TERMINAL, Job, JobState, JobTemplate, Priority
from .selectors import LogPage, job_gpu_samples, jobs_for_list, log_end, log_read, task_histograms
from .services import (job_cancel, job_hold, job_move, job_release, job_resubmit, job_spec_check, job_submit,
                       job_update, jobs_cancel)

PAGE_SIZE = 50
POLL_LIST = "every 3s"
POLL_DETAIL = "every 2s"
# A finished job's log is still polled this long: the agent may ship the tail after the end.
LOG_GRACE_S = 30
# The detail page opens on the end of the log; the raw log has all of it.
LOG_TAIL_BYTES = 256 * 1024
STATE_ORDER = {state: i for i, state in enumerate(JobState.values)}


def histogram_items(counts: dict[str, int] | None) -> list[dict]:
    """[{state, label, n, percent}] in lifecycle order, for an array's state histogram."""
    if not counts:
        return []
    total = sum(counts.values())
    labels = dict(JobState.choices)
    return [{"state": s, "label": labels.get(s, s), "n": n, "percent": round(n * 100 / total, 1)}
            for s, n in sorted(counts.items(), key=lambda kv: STATE_ORDER.get(kv[0], 99))]


def cancellable(job: Job) -> bool:
    return job.state in CANCELLABLE


class JobListView(PageMixin, View):
    """Jobs of my projects with filters in the URL; htmx polls swap only the rows that changed."""

    def get(self, request):
        projects = Project.objects.for_user(request.user, "view").order_by("slug")
        filters = JobFilterForm(request.GET or None, projects=projects)
        paginator = Paginator(jobs_for_list(user=request.user, **filters.filters()), PAGE_SIZE)
        page = paginator.get_page(request.GET.get("page"))
        jobs = list(page.object_list)
        histograms = task_histograms([j.pk for j in jobs if j.is_array_parent])
        rows = []
        for job in jobs:
            ctx = {"job": job, "hist": histogram_items(histograms.get(job.pk)), "cancellable": cancellable(job)}
            html = render_to_string("jobs/_job_row.html", ctx, request)
            rows.append((job.pk, ctx, html, version(html)))
        versions = ",".join(f"{pk}:{v}" for pk, _, _, v in rows)
        query = request.GET.copy()
        query.pop("v", None)
        poller = {"poll_url": f"{request.path}?{query.urlencode()}", "versions": versions, "trigger": POLL_LIST}
        if request.htmx and "v" in request.GET:
            return self._poll_answer(request, rows, poller)
        query.pop("page", None)
        return render(request, "jobs/list.html", {
            "filters": filters, "page": page, "rows": [html for _, _, html, _ in rows], "poller": poller,
            "query": query.urlencode(), "back": request.get_full_path(),
        })

    def _poll_answer(self, request, rows, poller):
        known = dict(part.split(":", 1) for part in request.GET["v"].split(",") if ":" in part)
        same_rows = [str(pk) for pk, *_ in rows] == list(known)
        if same_rows:
            changed = [render_to_string("jobs/_job_row.html", {**ctx, "oob": True}, request)
                       for pk, ctx, _, v in rows if known.get(str(pk)) != v]
            if not changed:
                return HttpResponse(status=204)
            return render(request, "jobs/_list_poll.html", {"poller": poller, "changed_rows": changed})
        # Rows came, went or moved: replace the whole body.
        return render(request, "jobs/_list_poll.html",
                      {"poller": poller, "replace_all": True, "tbody": [html for _, _, html, _ in rows]})


class JobSubmitView(PageMixin, View):
    """A blank form, or one filled from a template (?template=ID); POST builds the API's dict."""

    def _template(self, request):
        raw = request.POST.get("template") or request.GET.get("template")
        if not raw:
            return None
        if parse_int(raw) is None:
            raise Http404("No such template.")
        return scoped_or_404(JobTemplate, request, pk=parse_int(raw))

    def _render(self, request, form, status=200):
        return render(request, "jobs/submit.html", {"form": form, "template": form.template,
                                                    "has_projects": bool(form.fields["project"].choices)},
                      status=status)

    def _projects(self, request):
        return Project.objects.for_user(request.user, "submit").select_related("organization").order_by("slug")

    def get(self, request):
        template = self._template(request)
        initial = JobSubmitForm.initial_from_template(template) if template else {}
        return self._render(request, JobSubmitForm(initial=initial, projects=self._projects(request),
                                                   template=template))

    def post(self, request):
        template = self._template(request)
        initial = JobSubmitForm.initial_from_template(template) if template else {}
        form = JobSubmitForm(request.POST, initial=initial, projects=self._projects(request), template=template)
        if not form.is_valid():
            # With the API's verdict on the inputs that passed: every problem in one answer.
            try:
                job_spec_check(actor=self.actor, data=form.spec())
            except ServiceError as exc:
                form.add_api_errors(exc.as_fields(), None if exc.fields else exc.message, beside_own=True)
            return self._render(request, form)
        try:
            job, _ = job_submit(actor=self.actor, data=form.spec())
        except ServiceError as exc:
            form.add_api_errors(exc.as_fields(), None if exc.fields else exc.message)
            return self._render(request, form)
        what = f"Array job {job.pk} ({job.array})" if job.is_array_parent else f"Job {job.pk}"
        messages.success(request, f"{what} submitted.")
        return redirect("jobs:detail", pk=job.pk)


def _job(request, pk):
    return scoped_or_404(Job.objects.select_related("project", "user", "node", "resubmit_of"), request, pk=pk)


def status_context(request, job: Job) -> dict:
    """What the live status block shows; its HTML version decides whether a poll swaps."""
    body = render_to_string("jobs/_status_body.html", {
        "job": job,
        "events": list(job.events.all()),
        "can_submit": user_can(request.user, "submit", job.project),
        "cancellable": cancellable(job),
        "resubmittable": job.state in TERMINAL and job.array_parent_id is None,
        # Hold, release and update act on the queue only (services.job_hold and the rest decide who may).
        "queue_control": job.state == JobState.QUEUED or (job.is_array_parent and job.state not in TERMINAL),
        "priorities": Priority.choices,
        # Operators move a running job elsewhere (services.job_move).
        "movable": request.user.is_staff and job.state in HOLDING,
    }, request)
    return {"job": job, "status_body": body, "status_version": version(body),
            "status_trigger": "" if job.state in TERMINAL else POLL_DETAIL}


def log_context(job: Job, attempt: int, page: LogPage, skipped: int = 0) -> dict:
    """The log section: ``page``'s text, then a poller that asks for what follows it (at once while
    more is stored, else every 2 s until the job has ended and the grace has passed)."""
    ended_long_ago = job.state in TERMINAL and job.ended_at and \
        (timezone.now() - job.ended_at).total_seconds() > LOG_GRACE_S
    behind = page.next_offset < page.size
    trigger = "load" if behind else "" if ended_long_ago and not page.data else POLL_DETAIL
    return {"job": job, "attempt": attempt, "log_text": page.data, "offset": page.next_offset,
            "log_trigger": trigger, "log_complete": bool(ended_long_ago) and not behind,
            "log_skipped": skipped, "log_truncated": page.truncated}


def log_tail(job: Job) -> dict:
    """The latest attempt's log for the detail page: its last LOG_TAIL_BYTES, from a line start."""
    size, _ = log_end(job, attempt=job.attempt)
    start = max(0, size - LOG_TAIL_BYTES)
    page = log_read(job, attempt=job.attempt, offset=start, limit=LOG_TAIL_BYTES)
    if start and "\n" in page.data:
        page = dataclasses.replace(page, data=page.data[page.data.index("\n") + 1:])
    return log_context(job, job.attempt, page, skipped=start)


ARTIFACTS_SHOWN = 200  # on the job page; gpuctl artifacts list and the API show all


def _artifacts(job) -> list:
    """The first ARTIFACTS_SHOWN + 1 artifacts, each with ``expires_at`` (None: kept forever)."""
    days = artifact_retention_days(job.project)
    shown = list(job.artifacts.order_by("-attempt", "path")[:ARTIFACTS_SHOWN + 1])
    for a in shown:
        a.expires_at = a.created_at + datetime.timedelta(days=days) if days else None
    return shown


class JobDetailView(PageMixin, View):
    def get(self, request, pk):
        job = _job(request, pk)
        tasks = []
        if job.is_array_parent:
            tasks = list(job.tasks.select_related("node").order_by("array_index")[:500])
        return render(request, "jobs/detail.html", {
            **status_context(request, job),
            **log_tail(job),
            "gpus": job_gpu_samples(job) if not job.is_array_parent else [],
            "gpus_live": job.state in HOLDING,
            "charts_live": job.state not in TERMINAL,
            "depends_on": list(job.depends_on.all()),
            "tasks": tasks,
            "histogram": histogram_items(task_histograms([job.pk]).get(job.pk)) if job.is_array_parent else [],
            # What its attempts left in /outputs (docs/storage.md); downloads go through the jobs API.
            "artifacts": _artifacts(job),
            "artifacts_shown": ARTIFACTS_SHOWN,
        })


class JobStatusView(PageMixin, View):
    """The state, reason, queue position, buttons and timeline, for the detail page's poll."""

    def get(self, request, pk):
        job = _job(request, pk)
        ctx = status_context(request, job)
        if request.htmx and request.GET.get("v") == ctx["status_version"]:
            return HttpResponse(status=204)
        # The job moved: its GPUs may have changed too (assigned, released), so they come along.
        gpus = job_gpu_samples(job) if not job.is_array_parent else []
        return render(request, "jobs/_status_poll.html", {**ctx, "gpus": gpus, "gpus_live": job.state in HOLDING})


class JobLogView(PageMixin, View):
    """htmx: the page after `offset`, appended to the log; otherwise the attempt's log as text/plain."""

    def get(self, request, pk):
        job = _job(request, pk)
        try:
            attempt = int(request.GET.get("attempt", job.attempt))
            offset = max(0, int(request.GET.get("offset", 0)))
        except ValueError:
            attempt, offset = job.attempt, 0
        if not 0 <= attempt < 2**31:  # the column's range: no lookup may overflow it
            attempt = job.attempt
        if not request.htmx:
            # Streamed page by page: a log may be JOB_LOG_MAX_BYTES long.
            return StreamingHttpResponse(_log_pages(job, attempt, offset), content_type="text/plain; charset=utf-8")
        if attempt != job.attempt:
            # A new attempt started: show its log from the beginning.
            return render(request, "jobs/_log_poll.html", {**log_tail(job), "replace": True})
        ctx = log_context(job, attempt, log_read(job, attempt=attempt, offset=offset))
        if not ctx["log_text"] and ctx["log_trigger"] == POLL_DETAIL:
            return HttpResponse(status=204)
        return render(request, "jobs/_log_poll.html", ctx)


def _log_pages(job: Job, attempt: int, offset: int):
    while True:
        page = log_read(job, attempt=attempt, offset=offset)
        if page.data:
            yield page.data
        if page.next_offset >= page.size or page.next_offset == offset:
            return
        offset = page.next_offset


class JobActionView(PageMixin, View):
    """A button on the job page: `act` on the job (a service, which decides who may), then back to
    the page with what `done` says, or with the refusal."""

    def act(self, job: Job) -> Job:
        raise NotImplementedError

    def done(self, job: Job) -> str:
        raise NotImplementedError

    def post(self, request, pk):
        job = _job(request, pk)
        back = reverse("jobs:detail", args=[job.pk])
        try:
            job = self.act(job)
        except ServiceError as exc:
            return refused(request, exc, back=back)
        messages.success(request, self.done(job))
        return redirect(back)


class JobCancelView(JobActionView):
    def act(self, job):
        return job_cancel(actor=self.actor, job=job)

    def done(self, job):
        return f"Job {job.pk} cancelled."


class JobMoveView(JobActionView):
    """Operators: move a running job to other GPUs (it checkpoints first if it can)."""

    def act(self, job):
        return job_move(actor=self.actor, job=job)

    def done(self, job):
        return f"Job {job.pk} is moving: requeued as attempt {job.attempt}."


class JobHoldView(PageMixin, View):
    """Hold (or, with release=True, release) a queued job from its page."""

    release = False

    def post(self, request, pk):
        job = _job(request, pk)
        back = reverse("jobs:detail", args=[job.pk])
        try:
            job = (job_release if self.release else job_hold)(actor=self.actor, job=job)
        except ServiceError as exc:
            return refused(request, exc, back=back)
        messages.success(request, f"Job {job.slurm_id} {'released' if self.release else 'held'}.")
        return redirect(back)


class JobUpdateView(PageMixin, View):
    """The job page's update form: time limit, priority, GPUs; every refused field is listed."""

    def post(self, request, pk):
        job = _job(request, pk)
        back = reverse("jobs:detail", args=[job.pk])
        # Only what the form changed (it opens filled in with the job's values), checked by the
        # API's own update serializer so both refuse the same input with the same field names.
        data = {}
        text = request.POST.get("time_limit", "").strip()
        if text and text != str(job.time_limit_s):
            data["time_limit"] = text
        priority = request.POST.get("priority", "")
        if priority and priority != job.priority:
            data["priority"] = priority
        text = request.POST.get("gpus", "").strip()
        if text:
            data["resources"] = {"gpus": text}
        try:
            v = check_valid(JobUpdateSerializer(data=data))
            gpus = v.get("resources", {}).get("gpus")
            job = job_update(actor=self.actor, job=job, time_limit=v.get("time_limit"), priority=v.get("priority"),
                             gpus=None if gpus == job.gpus else gpus)  # nothing changed: it says so
        except ServiceError as exc:
            if not exc.fields:
                return refused(request, exc, back=back)
            messages.error(request, "Not updated: " + "; ".join(
                f"{k}: {' '.join(str(m) for m in v)}" for k, v in exc.as_fields().items()))
            return redirect(back)
        messages.success(request, f"Job {job.slurm_id} updated.")
        return redirect(back)


class JobResubmitView(PageMixin, View):
    def post(self, request, pk):
        job = _job(request, pk)
        try:
            new = job_resubmit(actor=self.actor, job=job)
        except ServiceError as exc:
            if exc.fields:
                messages.error(request, "; ".join(f"{k}: {v[0]}" for k, v in exc.as_fields().items()))
                return redirect("jobs:detail", pk=job.pk)
            return refused(request, exc, back=reverse("jobs:detail", args=[job.pk]))
        dropped = " without its environment (only its owner's resubmits keep it)" if job.env and not new.env else ""
        messages.success(request, f"Job {job.pk} resubmitted as job {new.pk}{dropped}.")
        return redirect("jobs:detail", pk=new.pk)


class JobBulkCancelView(PageMixin, View):
    """Cancel several jobs: the first POST shows what would be cancelled, the second (confirm) does it."""

    def post(self, request):
        back = request.POST.get("back", "")
        list_url = reverse("jobs:list")
        back = back if back.startswith(list_url + "?") or back == list_url else list_url
        ids = parse_ints(request.POST.getlist("ids"), limit=PAGE_SIZE * 4)
        jobs = list(Job.objects.for_user(request.user, "view").filter(pk__in=ids)
                    .select_related("project", "user").order_by("-submitted_at", "-id"))
        if not jobs:
            messages.error(request, "Select at least one job to cancel.")
            return redirect(back)
        if request.POST.get("confirm") != "yes":
            return render(request, "jobs/bulk_cancel.html", {"jobs": jobs, "back": back})
        done, refusals = jobs_cancel(actor=self.actor, jobs=jobs)
        if done:
            messages.success(request, f"Cancelled {len(done)} job{'s' if len(done) != 1 else ''}: "
                                      f"{', '.join(map(str, done))}.")
        for text in refusals:
            messages.error(request, text)
        return redirect(back)
