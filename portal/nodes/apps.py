from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "portal.nodes"
    label = "nodes"
    verbose_name = "Nodes and GPUs"
