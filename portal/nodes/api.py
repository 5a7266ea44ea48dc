from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from portal.core.api import ActorMixin, StrictSerializer

from .models import GPU, Node
from .services import node_drain, node_undrain


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "model", "memory_mb", "pci_bus_id", "mode", "health", "health_reason"]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GPUSerializer(many=True, read_only=True)
    # Whether new jobs land here, and if not yet, why (its agent has not registered or not
    # answered the probe on its queue).
    schedulable = serializers.BooleanField(read_only=True)
    waiting_for = serializers.CharField(read_only=True)

    class Meta:
        model = Node
        fields = ["name", "state", "state_reason", "schedulable", "waiting_for", "pool", "labels", "cpus",
                  "memory_mb", "sandbox", "last_heartbeat_at", "created_at", "gpus"]


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
