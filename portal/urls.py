from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from portal.console.nodes import ClusterView
from portal.metrics.views import JobMetricsView

api_v1 = [
    path("", include("portal.accounts.urls_api")),
    path("", include("portal.tenancy.urls_api")),
    path("", include("portal.jobs.urls_api")),
    path("", include("portal.console.urls_nodes_api")),
    path("", include("portal.billing.urls_api")),
    path("", include("portal.storage.urls_api")),
    path("", include("portal.interactive.urls_api")),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include((api_v1, "api"))),
    path("api/agent/v1/", include("portal.agentapi.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves Swagger UI's start-up script as a file: no inline script (CSP).
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("", include("portal.accounts.urls")),
    path("", include("portal.pages.urls")),
    path("projects/<slug:slug>/volumes/", include(("portal.storage.urls", "volumes"))),
    path("projects/<slug:slug>/datasets/", include(("portal.storage.urls_datasets", "datasets"))),
    path("jobs/", include("portal.jobs.urls")),
    # The job page's GPU charts: metrics sit above jobs, so the route is composed here.
    path("jobs/<int:pk>/metrics/", JobMetricsView.as_view(), name="job-metrics"),
    path("nodes/", include("portal.console.urls_nodes")),
    path("cluster/", ClusterView.as_view(), name="cluster"),
    path("metrics", include("portal.metrics.urls")),
    path("console/", include("portal.console.urls")),
]
