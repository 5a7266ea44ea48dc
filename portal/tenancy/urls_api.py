from django.urls import path
from rest_framework.routers import SimpleRouter

from .api import MemberViewSet, OrganizationViewSet, ProjectViewSet

router = SimpleRouter()
router.register("organizations", OrganizationViewSet, basename="organization")
router.register("projects", ProjectViewSet, basename="project")

members = MemberViewSet.as_view({"get": "list", "post": "create"})
member = MemberViewSet.as_view({"get": "retrieve", "patch": "partial_update", "delete": "destroy"})

urlpatterns = [
    *router.urls,
    path("projects/<slug:project_slug>/members/", members, name="project-members"),
    path("projects/<slug:project_slug>/members/<str:username>/", member, name="project-member"),
]
