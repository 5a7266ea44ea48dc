from django.urls import path
from rest_framework.routers import SimpleRouter

from .nodes_api import ClusterView, NodeViewSet

router = SimpleRouter()
router.register("nodes", NodeViewSet, basename="node")
urlpatterns = [path("cluster/", ClusterView.as_view(), name="cluster"), *router.urls]
