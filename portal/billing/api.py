"""Billing API: usage (JSON or CSV), invoices, budgets. Every read is scoped by a for_user queryset."""
import csv
import io
from datetime import datetime, time, timezone as dt_timezone

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, renderers, serializers, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.core.api import ActorMixin

from .models import Invoice, InvoiceLine
from .selectors import GROUP_BY, JOB_ACCOUNTING_MAX, budget_status, job_accounting, usage_report


class CSVRenderer(renderers.BaseRenderer):
    """`?format=csv`: the report's rows with a header row (an error becomes one error row)."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        out = io.StringIO()
        writer = csv.writer(out)
        if isinstance(data, dict) and "error" in data:
            writer.writerow(["error", "message"])
            writer.writerow([data["error"].get("code"), data["error"].get("message")])
            return out.getvalue().encode()
        rows = data.get("results", []) if isinstance(data, dict) else data
        if rows:
            writer.writerow(list(rows[0]))
            for row in rows:
                writer.writerow([_cell(v) for v in row.values()])
        elif isinstance(data, dict) and data.get("group_by"):
            writer.writerow([data["group_by"], "gpu_seconds", "gpu_hours", "amount"])
        return out.getvalue().encode()


def _cell(value):
    text = "" if value is None else str(value)
    # A cell starting with = + - @ is a formula to spreadsheet programs (CSV injection).
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


class WhenField(serializers.Field):
    """A date (2026-11-01, midnight UTC) or an ISO 8601 time (UTC unless it says otherwise)."""

    def to_internal_value(self, data):
        if not data:
            return None
        try:
            value = datetime.fromisoformat(str(data))
        except ValueError:
            raise serializers.ValidationError("Use a date (2026-11-01) or an ISO 8601 time.") from None
        if len(str(data)) == 10:
            value = datetime.combine(value.date(), time(0))
        return value if value.tzinfo else value.replace(tzinfo=dt_timezone.utc)

    def to_representation(self, value):
        return value.isoformat() if value else None


class UsageQuerySerializer(serializers.Serializer):
    organization = serializers.SlugField(required=False, default="")
    project = serializers.SlugField(required=False, default="")
    group_by = serializers.ChoiceField(choices=list(GROUP_BY), required=False, default="day")

    def get_fields(self):
        # `from`/`to` are Python keywords: declared here rather than as attributes. As fields,
        # a bad date is reported together with every other bad parameter.
        return {**super().get_fields(), "from": WhenField(required=False, default=None),
                "to": WhenField(required=False, default=None)}

    def validate(self, attrs):
        if attrs["from"] and attrs["to"] and attrs["from"] >= attrs["to"]:
            raise serializers.ValidationError({"to": ["Must be after 'from'."]})
        return attrs


class UsageView(ActorMixin, APIView):
    """GPU usage of the projects you may see, summed by day, project, organization, user or GPU model."""

    renderer_classes = [renderers.JSONRenderer, CSVRenderer]

    def required_scope(self) -> str:
        return "read"

    @extend_schema(parameters=[
        OpenApiParameter("organization", str), OpenApiParameter("project", str),
        OpenApiParameter("from", str, description="date or ISO time, inclusive"),
        OpenApiParameter("to", str, description="date or ISO time, exclusive"),
        OpenApiParameter("group_by", str, enum=list(GROUP_BY)),
        OpenApiParameter("format", str, enum=["json", "csv"]),
    ], responses={200: dict})
    def get(self, request):
        params = UsageQuerySerializer(data={k: v for k, v in request.query_params.items() if k != "format"})
        params.is_valid(raise_exception=True)
        v = params.validated_data
        report = usage_report(user=request.user, restricted_project_id=self.actor.restricted_project_id,
                              organization=v["organization"], project=v["project"], start=v["from"], end=v["to"],
                              group_by=v["group_by"])
        response = Response(report)
        if request.accepted_renderer.format == "csv":
            response["Content-Disposition"] = f'attachment; filename="usage-by-{v["group_by"]}.csv"'
        return response


class JobUsageQuerySerializer(UsageQuerySerializer):
    group_by = None
    organization = None
    user = serializers.CharField(max_length=150, required=False, default="")
    job = serializers.CharField(max_length=2000, required=False, default="",
                                help_text="Comma-separated job ids (array tasks as 3_0 are resolved by gpuctl).")
    limit = serializers.IntegerField(min_value=1, max_value=JOB_ACCOUNTING_MAX, required=False, default=100)

    def validate_job(self, value):
        if not value:
            return None
        parts = [p.strip() for p in value.split(",")]
        if len(parts) > JOB_ACCOUNTING_MAX or not all(p.isascii() and p.isdigit() and len(p) < 19 for p in parts):
            raise serializers.ValidationError(f"Job ids like 12,13 (at most {JOB_ACCOUNTING_MAX}).")
        return [int(p) for p in parts]


class JobUsageRowSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    slurm_id = serializers.CharField(help_text="An array task as <array job>_<index>.")
    name = serializers.CharField()
    project = serializers.CharField()
    user = serializers.CharField()
    state = serializers.CharField()
    exit_code = serializers.IntegerField(allow_null=True)
    gpus = serializers.FloatField()
    gpu_types = serializers.ListField(child=serializers.CharField())
    started_at = serializers.DateTimeField(allow_null=True)
    ended_at = serializers.DateTimeField(allow_null=True)
    elapsed = serializers.IntegerField(allow_null=True, help_text="Seconds from first start to end (or now).")
    gpu_seconds = serializers.FloatField(help_text="Allocated GPU-seconds over all attempts (x fraction).")
    gpu_hours = serializers.FloatField()
    gpu_efficiency = serializers.FloatField(allow_null=True, help_text="Mean GPU utilization over its allocations, "
                                                                       "0..1 (seff's used / allocated); null "
                                                                       "without samples.")
    amount = serializers.FloatField(allow_null=True, help_text="Metered cost so far (hourly); null if not metered.")
    currency = serializers.CharField()


class JobUsageSerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="Jobs that match; `results` holds the newest `limit`.")
    results = JobUsageRowSerializer(many=True)
    total = serializers.DictField(help_text="gpu_seconds, gpu_hours and amount over `results`.")


class JobUsageView(ActorMixin, APIView):
    """Per-job accounting (like sacct and seff): GPU-hours, GPU efficiency and cost of each job of
    the projects you may see that held GPUs in the range, newest first."""

    def required_scope(self) -> str:
        return "read"

    @extend_schema(parameters=[
        OpenApiParameter("project", str), OpenApiParameter("user", str, description="a username"),
        OpenApiParameter("from", str, description="date or ISO time, inclusive"),
        OpenApiParameter("to", str, description="date or ISO time, exclusive"),
        OpenApiParameter("job", str, description="comma-separated job ids"),
        OpenApiParameter("limit", int, description=f"at most this many jobs (default 100, max {JOB_ACCOUNTING_MAX})"),
    ], responses=JobUsageSerializer)
    def get(self, request):
        params = JobUsageQuerySerializer(data=dict(request.query_params.items()))
        params.is_valid(raise_exception=True)
        v = params.validated_data
        return Response(job_accounting(user=request.user, restricted_project_id=self.actor.restricted_project_id,
                                       project=v["project"], username=v["user"], start=v["from"], end=v["to"],
                                       job_ids=v["job"], limit=v["limit"]))


class InvoiceLineSerializer(serializers.ModelSerializer):
    project = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    gpu_hours = serializers.DecimalField(max_digits=18, decimal_places=3, read_only=True)

    class Meta:
        model = InvoiceLine
        fields = ["project", "gpu_model", "gpu_seconds", "gpu_hours", "amount"]


class InvoiceSerializer(serializers.ModelSerializer):
    organization = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    month = serializers.DateField(format="%Y-%m")

    class Meta:
        model = Invoice
        fields = ["id", "number", "organization", "month", "status", "currency", "gpu_seconds", "total",
                  "generated_at"]


class InvoiceDetailSerializer(InvoiceSerializer):
    lines = InvoiceLineSerializer(many=True, read_only=True)

    class Meta(InvoiceSerializer.Meta):
        fields = InvoiceSerializer.Meta.fields + ["lines"]


class InvoiceViewSet(ActorMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Monthly invoices: an organization's owners see its own, staff see all, anyone else none (404)."""

    serializer_class = InvoiceSerializer
    filterset_fields = ["status"]

    def required_scope(self) -> str:
        return "read"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Invoice.objects.none()
        qs = Invoice.objects.for_user(self.request.user, "view", project_id=self.actor.restricted_project_id)
        qs = qs.select_related("organization").order_by("-month", "organization__slug")
        if self.action == "retrieve":
            qs = qs.prefetch_related("lines__project")
        return qs

    def get_serializer_class(self):
        return InvoiceDetailSerializer if self.action == "retrieve" else InvoiceSerializer


class BudgetView(ActorMixin, APIView):
    """This month's GPU-hour budget of each project you may see: used, share, and level
    (`ok`, `warning` from 80%, `exceeded` at 100%; with `hard_stop` the scheduler holds new work)."""

    def required_scope(self) -> str:
        return "read"

    @extend_schema(responses={200: dict})
    def get(self, request):
        return Response({"results": budget_status(user=request.user,
                                                  restricted_project_id=self.actor.restricted_project_id)})
