from rest_framework.routers import SimpleRouter

from .api import DatasetViewSet, JobArtifactViewSet, RegistryCredentialViewSet, VolumeViewSet

router = SimpleRouter()
router.register("volumes", VolumeViewSet, basename="volume")
router.register("datasets", DatasetViewSet, basename="dataset")
router.register("registry-credentials", RegistryCredentialViewSet, basename="registry-credential")
router.register(r"jobs/(?P<job_pk>[0-9]+)/artifacts", JobArtifactViewSet, basename="job-artifact")

urlpatterns = router.urls
