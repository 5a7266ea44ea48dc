import functools
import threading
from collections import Counter
from decimal import Decimal

import django_filters
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from portal.core.api import StrictModelSerializer, StrictSerializer, TenantViewSet
from portal.core.filters import UtcDateTimeFilter
from portal.core.numbers import count_or_fraction
from portal.tenancy.api import ProjectChoiceSerializer

from .models import TERMINAL, Job, JobEvent, JobTemplate, Priority
from .selectors import LOG_PAGE_MAX_BYTES, env_reader_project_ids, env_visible, log_read, task_histograms
from .services import (job_cancel, job_hold, job_move, job_release, job_resubmit, job_submit, job_submit_batch,
                       job_update, template_delete, template_save)
from .spec import DurationField, JobSpecSerializer


class JobEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobEvent
        fields = ["state", "attempt", "message", "at"]


class JobResourcesSerializer(serializers.Serializer):
    """What a job holds or asks for (the schema of JobSerializer.resources)."""

    gpus = serializers.FloatField(help_text="All of the job's GPUs (a fraction below 1: a share of one GPU).")
    nodes = serializers.IntegerField(help_text="Nodes it spans: 1 unless it asked for more.")
    gpus_per_node = serializers.FloatField(help_text="GPUs on each of its nodes.")
    gpu_type = serializers.CharField()
    gpu_memory_mb = serializers.IntegerField()
    cpus = serializers.FloatField()
    memory_mb = serializers.IntegerField()


class JobCheckpointSerializer(serializers.Serializer):
    signal = serializers.CharField()
    grace_s = serializers.IntegerField()
    interval_s = serializers.IntegerField(required=False, help_text="Present when the job saves on its own every "
                                                                    "this many seconds of its run.")


class JobSerializer(serializers.ModelSerializer):
    project = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    user = serializers.SlugRelatedField(slug_field="username", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    template = serializers.SlugRelatedField(slug_field="name", read_only=True)
    env = serializers.SerializerMethodField(help_text="The job's environment, shown to its owner and the project's "
                                                      "owners and admins only (it often holds secrets); null for "
                                                      "everyone else.")
    resources = serializers.SerializerMethodField()
    reason = serializers.SerializerMethodField()
    depends_on = serializers.PrimaryKeyRelatedField(many=True, read_only=True)
    time_limit = serializers.IntegerField(source="time_limit_s", read_only=True)
    slurm_code = serializers.CharField(read_only=True)
    slurm_id = serializers.CharField(read_only=True, help_text="Slurm's name for it: an array task as "
                                                                "<array job>_<index> (\"3_0\"), else the id.")
    elapsed = serializers.IntegerField(source="elapsed_s", read_only=True, allow_null=True,
                                       help_text="Seconds from its first start to its end (or now); null if it "
                                                 "never started.")
    tasks = serializers.SerializerMethodField(help_text="Array parents: count of tasks per state.")
    warnings = serializers.ListField(child=serializers.CharField(), read_only=True,
                                     help_text="What the node could not enforce (e.g. a GPU share without CUDA MPS).")
    volumes = serializers.ListField(child=serializers.DictField(), read_only=True,
                                    help_text="The project's volumes mounted at /data/<name>: {name, read_only}.")
    datasets = serializers.ListField(child=serializers.DictField(), read_only=True, help_text=(
        "The datasets it reads at /datasets/<name>, as resolved at submit: {name, version, digest, size, source}."))
    checkpoint = JobCheckpointSerializer(read_only=True, allow_null=True,
                                         help_text="{signal, grace_s[, interval_s]} when the job checkpoints, else null.")

    class Meta:
        model = Job
        fields = ["id", "project", "user", "name", "image", "command", "env", "resources", "time_limit", "priority",
                  "preemptible", "do_not_disrupt", "checkpoint", "sandbox", "network", "volumes", "datasets", "array", "is_array_parent", "array_parent", "array_index",
                  "array_limit", "depends_on", "template", "resubmit_of", "state", "held", "slurm_code", "slurm_id", "attempt", "reason",
                  "queue_position", "node", "placement_topology", "exit_code", "submitted_at", "started_at", "ended_at", "elapsed", "tasks",
                  "idle_since", "warnings"]
        extra_kwargs = {"placement_topology": {"help_text": "How closely its GPUs are linked: nvlink (one NVLink "
                                                            "group), pcie (one PCIe switch), numa (one NUMA node), "
                                                            "system (across them); empty when not known."},
                        "held": {"help_text": "Held (POST .../hold/): stays queued with reason `held` and is not "
                                              "scheduled until released (POST .../release/)."},
                        "idle_since": {"help_text": "Set while every GPU of the running job has stayed under "
                                                    "the idle threshold (GPU_IDLE_UTIL_PCT, GPU_IDLE_MINUTES)."}}

    @extend_schema_field(JobResourcesSerializer)
    def get_resources(self, job) -> dict:
        return {"gpus": count_or_fraction(job.gpus), "nodes": job.nodes,
                "gpus_per_node": count_or_fraction(job.gpus_per_node),
                "gpu_type": job.gpu_type, "gpu_memory_mb": job.gpu_memory_mb,
                "cpus": float(job.cpus), "memory_mb": job.memory_mb}

    def get_env(self, job) -> dict[str, str] | None:
        request = self.context.get("request")
        if request is None or "env_readers" not in self.context:
            return None  # no caller to decide for: show nothing
        return job.env if env_visible(job, request.user, self.context["env_readers"]) else None

    def get_reason(self, job) -> dict | None:
        if not job.reason_code:
            return None
        return {"code": job.reason_code, "message": job.reason_message}

    def get_tasks(self, job) -> dict | None:
        if not job.is_array_parent:
            return None
        histograms = self.context.get("histograms")
        if histograms is None:
            return dict(Counter(job.tasks.values_list("state", flat=True)))
        return histograms.get(job.pk, {})


# One JobSerializer a thread, for the submit's answer (`_job_answer`).
_answerers = threading.local()


def _job_answer(job: Job, context: dict) -> dict:
    """``JobSerializer(job, context=context).data``. A serializer made for each request builds its
    fields from the model (most of what serializing one job costs); the submit's answer is written
    by one instance a thread instead, whose context is this request's while it writes. Its fields
    keep no state of their own between calls: they read the job and, through their root, the
    context (tests/jobs/test_submit.py compares the answer with a GET of the job)."""
    answerer = getattr(_answerers, "serializer", None)
    if answerer is None:
        answerer = _answerers.serializer = JobSerializer()
        answerer.fields  # bound once
    answerer._context = context
    try:
        return answerer.to_representation(job)
    finally:
        answerer._context = {}


class JobDetailSerializer(JobSerializer):
    events = JobEventSerializer(many=True, read_only=True)

    class Meta(JobSerializer.Meta):
        fields = JobSerializer.Meta.fields + ["events"]


class JobFilter(django_filters.FilterSet):
    project = django_filters.CharFilter(field_name="project__slug")
    state = django_filters.BaseInFilter(field_name="state")
    user = django_filters.CharFilter(field_name="user__username")
    array_parent = django_filters.NumberFilter(field_name="array_parent_id")
    array_index = django_filters.NumberFilter(field_name="array_index", help_text="With array_parent: task 3_0 is "
                                                                                  "array_parent=3&array_index=0.")
    submitted_after = UtcDateTimeFilter(field_name="submitted_at", lookup_expr="gte")
    submitted_before = UtcDateTimeFilter(field_name="submitted_at", lookup_expr="lt")
    active = django_filters.BooleanFilter(method="filter_active")
    held = django_filters.BooleanFilter(field_name="held", help_text="true: only held jobs (see .../hold/)")
    tasks = django_filters.BooleanFilter(method="filter_tasks", help_text="false: hide array tasks (default shows all)")

    class Meta:
        model = Job
        fields = []

    def filter_active(self, queryset, name, value):
        return queryset.exclude(state__in=TERMINAL) if value else queryset.filter(state__in=TERMINAL)

    def filter_tasks(self, queryset, name, value):
        return queryset if value else queryset.filter(array_parent__isnull=True)


class JobUpdateResourcesSerializer(StrictSerializer):
    gpus = serializers.DecimalField(max_digits=6, decimal_places=3, min_value=Decimal(0), help_text="All GPUs of the job.")


class JobUpdateSerializer(StrictSerializer):
    """What `scontrol update` changes on a queued job; give any of them."""

    time_limit = DurationField(required=False, help_text="Seconds or a duration ('2h', '1-00:00:00'). Its "
                                                         "submitter may lower it; project owners and admins "
                                                         "may raise it up to the project maximum.")
    priority = serializers.ChoiceField(choices=Priority.choices, required=False,
                                       help_text="Lower it freely; raising it takes the owner or admin role.")
    resources = JobUpdateResourcesSerializer(required=False, help_text="The GPU count, within the project limit.")


class LogsSerializer(serializers.Serializer):
    attempt = serializers.IntegerField()
    offset = serializers.IntegerField(help_text="Byte offset this page starts at.")
    next_offset = serializers.IntegerField(help_text="Byte offset to ask for next; equals `size` once all is read.")
    size = serializers.IntegerField(help_text="Bytes stored for this attempt so far.")
    data = serializers.CharField(help_text="The page's bytes as UTF-8 text; invalid bytes and NUL read as U+FFFD.")
    complete = serializers.BooleanField(help_text="True once the job has ended: the agent ships the tail first, "
                                                  "so nothing is added after `size`.")
    truncated = serializers.BooleanField(help_text="The log reached JOB_LOG_MAX_BYTES; it ends with a notice.")


class LogsQuerySerializer(serializers.Serializer):
    offset = serializers.IntegerField(min_value=0, max_value=2**53, required=False, default=0)
    limit = serializers.IntegerField(min_value=1, max_value=LOG_PAGE_MAX_BYTES, required=False,
                                     default=LOG_PAGE_MAX_BYTES)
    attempt = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)


class JobBatchSerializer(serializers.Serializer):
    """A batch submit (documentation only: services.job_submit_batch checks it)."""

    jobs = serializers.ListField(child=JobSpecSerializer(), min_length=1,
                                 help_text="Job specs; each is `defaults` under its own fields. At most "
                                           "JOB_BATCH_MAX_JOBS (10,000). Any refused job refuses the batch: "
                                           "errors name `jobs[i].field`.")
    defaults = serializers.DictField(required=False, help_text="Spec fields every job of the batch shares.")


class JobBatchResultSerializer(serializers.Serializer):
    ids = serializers.ListField(child=serializers.IntegerField(), help_text="The new jobs, in the order given.")


class JobViewSet(mixins.ListModelMixin, TenantViewSet):
    """Jobs of the projects you may see. Submit with `submit` scope; cancel returns 202."""

    scoped_model = Job
    serializer_class = JobSerializer
    filterset_class = JobFilter
    scope_for_action = {"create": "submit", "batch": "submit", "cancel": "submit", "resubmit": "submit",
                        "hold": "submit", "release": "submit", "partial_update": "submit"}

    def get_queryset(self):
        qs = super().get_queryset().select_related("project", "user", "node", "template")
        qs = qs.prefetch_related("depends_on").order_by("-submitted_at", "-id")
        if self.action == "retrieve":
            qs = qs.prefetch_related("events")
        return qs

    def get_serializer_context(self):
        context = {**super().get_serializer_context(), **getattr(self, "_extra_context", {})}
        if not getattr(self, "swagger_fake_view", False):
            # Asked at most once, and only for a job that is not the caller's own.
            context["env_readers"] = functools.cache(functools.partial(env_reader_project_ids, self.request.user))
        return context

    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        self._extra_context = {"histograms": task_histograms([j.pk for j in page if j.is_array_parent])}
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(responses=JobDetailSerializer)
    def retrieve(self, request, pk=None):
        return Response(JobDetailSerializer(self.get_object(), context=self.get_serializer_context()).data)

    @extend_schema(request=JobSpecSerializer, responses={201: JobSerializer, 200: JobSerializer},
                   parameters=[OpenApiParameter(
                       "Idempotency-Key", str, OpenApiParameter.HEADER, required=False,
                       description="Retry-safe submit: the same key with the same body returns the first job (200); "
                                   "with any other body it is refused (422).")])
    def create(self, request):
        key = request.headers.get("Idempotency-Key", "")
        if len(key) > 128:
            raise serializers.ValidationError({"Idempotency-Key": ["At most 128 characters."]})
        job, created = job_submit(actor=self.actor, data=request.data, idempotency_key=key)
        if not created or job.is_array_parent:  # a replayed job, or one whose tasks are counted: read back
            job = self.get_queryset().get(pk=job.pk)
        return Response(_job_answer(job, self.get_serializer_context()),
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=JobBatchSerializer, responses={201: JobBatchResultSerializer})
    @action(detail=False, methods=["post"])
    def batch(self, request):
        """Submit many jobs at once, all or nothing: each is `defaults` under its own fields."""
        ids = job_submit_batch(actor=self.actor, data=request.data)
        return Response({"ids": ids}, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = job_cancel(actor=self.actor, job=self.get_object())
        return Response(JobSerializer(job, context=self.get_serializer_context()).data,
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def move(self, request, pk=None):
        """Operators: move a running job to other GPUs. It is requeued as its next attempt; a job that
        checkpoints gets its signal and grace to save first and resumes from its checkpoint."""
        job = job_move(actor=self.actor, job=self.get_object())
        return Response(JobSerializer(job, context=self.get_serializer_context()).data,
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def hold(self, request, pk=None):
        """Hold a queued job (an array: its queued tasks): it stays queued, reason `held`, until released."""
        job = job_hold(actor=self.actor, job=self.get_object())
        return Response(JobSerializer(job, context=self.get_serializer_context()).data)

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def release(self, request, pk=None):
        """Let a held job be scheduled again; it keeps its place by submit time."""
        job = job_release(actor=self.actor, job=self.get_object())
        return Response(JobSerializer(job, context=self.get_serializer_context()).data)

    @extend_schema(request=JobUpdateSerializer, responses={200: JobSerializer})
    def partial_update(self, request, pk=None):
        """Change a queued job's time limit, priority or GPU count (every refused field is reported)."""
        job = self.get_object()
        data = JobUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        job = job_update(actor=self.actor, job=job, time_limit=v.get("time_limit"), priority=v.get("priority"),
                         gpus=v.get("resources", {}).get("gpus"))
        return Response(JobSerializer(job, context=self.get_serializer_context()).data)

    @extend_schema(request=None, responses={201: JobSerializer})
    @action(detail=True, methods=["post"])
    def resubmit(self, request, pk=None):
        job = job_resubmit(actor=self.actor, job=self.get_object())
        return Response(JobSerializer(self.get_queryset().get(pk=job.pk), context=self.get_serializer_context()).data,
                        status=status.HTTP_201_CREATED)

    @extend_schema(responses=LogsSerializer, parameters=[
        OpenApiParameter("offset", int, description="byte offset to read from (default 0)"),
        OpenApiParameter("limit", int, description=f"at most this many bytes (default and maximum "
                                                   f"{LOG_PAGE_MAX_BYTES})"),
        OpenApiParameter("attempt", int, description="attempt (default: the latest)")])
    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        """One page of an attempt's log; read on from `next_offset` until it equals `size`."""
        job = self.get_object()
        query = LogsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        q = query.validated_data
        attempt = q.get("attempt", job.attempt)
        page = log_read(job, attempt=attempt, offset=q["offset"], limit=q["limit"])
        return Response({"attempt": attempt, "offset": page.offset, "next_offset": page.next_offset,
                         "size": page.size, "data": page.data, "complete": job.state in TERMINAL,
                         "truncated": page.truncated})


class JobTemplateSerializer(ProjectChoiceSerializer):
    spec = serializers.DictField()
    locked = serializers.ListField(child=serializers.CharField(max_length=32), required=False, default=list)

    class Meta:
        model = JobTemplate
        fields = ["id", "project", "name", "description", "spec", "locked", "created_at"]
        read_only_fields = ["id", "created_at"]


class JobTemplateViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenantViewSet):
    """Reusable job specs of a project: everyone in it reads, owners and admins write."""

    scoped_model = JobTemplate
    serializer_class = JobTemplateSerializer
    filterset_fields = {"project__slug": ["exact"]}

    def get_queryset(self):
        return super().get_queryset().select_related("project")

    def create(self, request):
        data = JobTemplateSerializer(data=request.data, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        v = data.validated_data
        template = template_save(actor=self.actor, project=v["project"], name=v["name"], spec=v["spec"],
                                 locked=v["locked"], description=v.get("description", ""))
        return Response(JobTemplateSerializer(template).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request, pk=None):
        template = self.get_object()
        if "project" in request.data:
            raise serializers.ValidationError({"project": ["A template cannot move to another project."]})
        data = JobTemplateSerializer(template, data=request.data, partial=True, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        v = {"name": template.name, "spec": template.spec, "locked": template.locked,
             "description": template.description, **data.validated_data}
        v.pop("project", None)
        template = template_save(actor=self.actor, project=template.project, template=template, **v)
        return Response(JobTemplateSerializer(template).data)

    def destroy(self, request, pk=None):
        template_delete(actor=self.actor, template=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)
