"""Node pages for site staff, under /nodes/ (the agent API is portal/agentapi/, the REST API
urls_nodes_api.py)."""
from django.urls import path

from . import nodes as views

app_name = "nodes"
urlpatterns = [
    path("", views.NodeListView.as_view(), name="list"),
    path("<str:name>/drain/", views.NodeDrainView.as_view(), name="drain"),
    path("<str:name>/undrain/", views.NodeUndrainView.as_view(), name="undrain"),
]
