"""Job pages (the API is in urls_api.py). Names: jobs:list, jobs:detail, ..."""
from django.urls import path

from . import views

app_name = "jobs"
urlpatterns = [
    path("", views.JobListView.as_view(), name="list"),
    path("new/", views.JobSubmitView.as_view(), name="submit"),
    path("cancel/", views.JobBulkCancelView.as_view(), name="bulk-cancel"),
    path("<int:pk>/", views.JobDetailView.as_view(), name="detail"),
    path("<int:pk>/status/", views.JobStatusView.as_view(), name="status"),
    path("<int:pk>/log/", views.JobLogView.as_view(), name="log"),
    path("<int:pk>/cancel/", views.JobCancelView.as_view(), name="cancel"),
    path("<int:pk>/resubmit/", views.JobResubmitView.as_view(), name="resubmit"),
    path("<int:pk>/hold/", views.JobHoldView.as_view(), name="hold"),
    path("<int:pk>/move/", views.JobMoveView.as_view(), name="move"),
    path("<int:pk>/release/", views.JobHoldView.as_view(release=True), name="release"),
    path("<int:pk>/update/", views.JobUpdateView.as_view(), name="update"),
]
