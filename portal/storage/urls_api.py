from rest_framework.routers import SimpleRouter

from .api import VolumeViewSet

router = SimpleRouter()
router.register("volumes", VolumeViewSet, basename="volume")

urlpatterns = router.urls
