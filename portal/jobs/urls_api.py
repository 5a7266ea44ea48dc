from rest_framework.routers import SimpleRouter

from .api import JobTemplateViewSet, JobViewSet

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("job-templates", JobTemplateViewSet, basename="jobtemplate")
urlpatterns = router.urls
