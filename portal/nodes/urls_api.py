from rest_framework.routers import SimpleRouter

from .api import NodeViewSet

router = SimpleRouter()
router.register("nodes", NodeViewSet, basename="node")
urlpatterns = router.urls
