from django.urls import path
from rest_framework.routers import SimpleRouter

from .api import MeView, NotificationPreferenceView, TokenViewSet

router = SimpleRouter()
router.register("tokens", TokenViewSet, basename="token")

urlpatterns = [
    path("me/", MeView.as_view(), name="me"),
    path("me/notifications/", NotificationPreferenceView.as_view(), name="me-notifications"),
    *router.urls,
]
