from django.contrib import admin

from .models import NodePool, PoolNode, ScaleEvent


@admin.register(NodePool)
class NodePoolAdmin(admin.ModelAdmin):
    list_display = ("name", "provider", "enabled", "gpu_model", "gpus_per_node", "price_per_gpu_hour", "min_nodes",
                    "max_nodes", "idle_release_s", "unavailable_until")
    readonly_fields = ("failures", "next_index", "unavailable_until", "unavailable_reason", "created_at")


@admin.register(PoolNode)
class PoolNodeAdmin(admin.ModelAdmin):
    list_display = ("name", "pool", "state", "created_at", "registered_at", "released_at", "reason")
    list_filter = ("pool", "state")
    readonly_fields = [f.name for f in PoolNode._meta.fields]


@admin.register(ScaleEvent)
class ScaleEventAdmin(admin.ModelAdmin):
    list_display = ("at", "pool", "kind", "delta", "size_after", "reason")
    list_filter = ("pool", "kind")
    readonly_fields = [f.name for f in ScaleEvent._meta.fields]
