from django.urls import path
from rest_framework.routers import SimpleRouter

from .api import MeView, TokenViewSet

router = SimpleRouter()
router.register("tokens", TokenViewSet, basename="token")

urlpatterns = [path("me/", MeView.as_view(), name="me"), *router.urls]
