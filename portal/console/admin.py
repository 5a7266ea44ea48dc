"""The console has no models of its own. Nodes and GPUs are registered here, above jobs and nodes,
because the admin's drain action moves jobs (jobs/node_effects.py), as the nodes page's does."""
from django.contrib import admin, messages

from portal.core.context import Actor, client_ip
from portal.core.errors import ServiceError
from portal.jobs.node_effects import node_drain
from portal.nodes.models import GPU, Node
from portal.nodes.services import node_undrain


class GPUInline(admin.TabularInline):
    model = GPU
    extra = 0
    fields = ("index", "uuid", "model", "memory_mb", "mode", "health", "health_reason")
    readonly_fields = ("uuid",)


def _bulk(service, verb):
    def act(modeladmin, request, queryset):
        actor = Actor(user=request.user, ip=client_ip(request))
        for node in queryset:
            try:
                service(actor=actor, node=node)
            except ServiceError as exc:
                modeladmin.message_user(request, f"{node.name}: {exc.message}", messages.WARNING)
        modeladmin.message_user(request, f"{verb} {queryset.count()} node(s).")
    act.short_description = f"{verb} selected nodes"
    act.__name__ = verb.lower()
    return act


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "pool", "sandbox", "last_heartbeat_at", "state_reason")
    list_filter = ("state", "pool", "sandbox")
    search_fields = ("name", "gpus__uuid")
    readonly_fields = ("token_digest", "last_heartbeat_at", "created_at", "state")
    inlines = [GPUInline]
    actions = [_bulk(node_drain, "Drain"), _bulk(node_undrain, "Undrain")]


@admin.register(GPU)
class GPUAdmin(admin.ModelAdmin):
    list_display = ("__str__", "uuid", "model", "mode", "health", "health_reason")
    list_filter = ("model", "mode", "health", "node__pool")
    search_fields = ("uuid", "node__name", "model")
