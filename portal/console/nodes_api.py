"""The nodes API (/api/v1/nodes/, site staff) and the cluster view (/api/v1/cluster/, everyone):
above jobs and nodes, as the nodes pages (nodes.py) are, since a drain moves jobs and the cluster
counts them."""
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.core.api import ActorMixin, StrictSerializer

from portal.jobs.node_effects import node_drain
from portal.nodes.models import GPU, Node
from portal.nodes.services import node_undrain

from .selectors import cluster_summary


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "model", "memory_mb", "pci_bus_id", "topology", "mode", "health", "health_reason"]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GPUSerializer(many=True, read_only=True)
    # Whether new jobs land here, and if not yet, why (its agent has not registered or not
    # answered the probe on its queue).
    schedulable = serializers.BooleanField(read_only=True)
    waiting_for = serializers.CharField(read_only=True)

    class Meta:
        model = Node
        fields = ["name", "state", "state_reason", "schedulable", "waiting_for", "pool", "labels", "cpus",
                  "memory_mb", "sandbox", "last_heartbeat_at", "created_at", "gpus", "protocol_version",
                  "cached_datasets"]
        extra_kwargs = {"cached_datasets": {"help_text": "SHA-256 digests of the dataset versions its agent's cache "
                                                         "holds (docs/storage.md, \"Datasets\")."}}


class DrainSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class NodeViewSet(ActorMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """GPU nodes (site staff only): state, GPUs and health; drain and undrain."""

    queryset = Node.objects.prefetch_related("gpus").order_by("name")
    serializer_class = NodeSerializer
    permission_classes = [permissions.IsAdminUser, *viewsets.GenericViewSet.permission_classes[1:]]
    lookup_field = "name"
    filterset_fields = ["state", "pool"]

    def required_scope(self) -> str:
        return "read" if self.request.method == "GET" else "admin"

    @extend_schema(request=DrainSerializer, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        data = DrainSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = node_drain(actor=self.actor, node=self.get_object(), reason=data.validated_data["reason"])
        return Response(NodeSerializer(node).data)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def undrain(self, request, name=None):
        return Response(NodeSerializer(node_undrain(actor=self.actor, node=self.get_object())).data)


class ClusterRowSerializer(serializers.Serializer):
    pool = serializers.CharField()
    gpu_type = serializers.CharField()
    memory_mb = serializers.IntegerField()
    nodes = serializers.IntegerField()
    node_states = serializers.DictField(child=serializers.IntegerField(),
                                        help_text="Nodes by state; `unverified`: ready, but its agent has not yet "
                                                  "proved it receives its queue.")
    total = serializers.IntegerField()
    used = serializers.FloatField(help_text="GPUs holding jobs (a shared GPU counts its fractions).")
    free = serializers.IntegerField(help_text="Healthy idle GPUs on nodes that take jobs.")
    unavailable = serializers.IntegerField(help_text="Idle GPUs that take no jobs: unhealthy, or the node is "
                                                     "draining, drained, down or unverified.")
    shared = serializers.IntegerField(help_text="GPUs in shared mode (fractional jobs).")


class ClusterTypeSerializer(serializers.Serializer):
    gpu_type = serializers.CharField()
    total = serializers.IntegerField()
    used = serializers.FloatField()
    free = serializers.IntegerField()
    unavailable = serializers.IntegerField()


class ClusterSerializer(serializers.Serializer):
    pools = ClusterRowSerializer(many=True)
    gpu_types = ClusterTypeSerializer(many=True)
    nodes = serializers.DictField(child=serializers.IntegerField(), help_text="Nodes by state.")
    jobs = serializers.DictField(help_text="Counts over all tenants: queued, queued_gpus, running.")


class ClusterView(ActorMixin, APIView):
    """The cluster at a glance for every signed-in user (like Slurm's `sinfo`): GPUs by pool and
    type, used, free and unavailable, and nodes by state. Counts only: no tenant's jobs."""

    def required_scope(self) -> str:
        return "read"

    @extend_schema(responses=ClusterSerializer)
    def get(self, request):
        return Response(cluster_summary())
