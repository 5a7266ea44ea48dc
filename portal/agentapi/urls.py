"""/api/agent/v1/: every report an agent sends, whichever app takes it."""
from django.urls import path

from portal.interactive.agent_api import SessionReportView
from portal.nodes import agent_api as nodes
from portal.storage.agent_api import ArtifactConfirmView, ArtifactDirectUploadView, ArtifactUploadView, DatasetFileView

from . import heartbeat, images, jobs

app_name = "agent"
urlpatterns = [
    path("register", nodes.RegisterView.as_view(), name="register"),
    path("heartbeat", heartbeat.HeartbeatView.as_view(), name="heartbeat"),
    path("probe", nodes.ProbeView.as_view(), name="probe"),
    path("events", jobs.EventsView.as_view(), name="events-batch"),
    path("confirms", jobs.ConfirmsView.as_view(), name="confirms-batch"),
    path("jobs/<str:job_id>/confirm", jobs.ConfirmView.as_view(), name="confirm"),
    path("jobs/<str:job_id>/events", jobs.EventView.as_view(), name="events"),
    path("jobs/<str:job_id>/logs", jobs.LogView.as_view(), name="logs"),
    path("jobs/<str:job_id>/artifacts", ArtifactUploadView.as_view(), name="artifacts"),
    path("jobs/<str:job_id>/artifacts/uploads", ArtifactDirectUploadView.as_view(), name="artifact-uploads"),
    path("jobs/<str:job_id>/artifacts/confirm", ArtifactConfirmView.as_view(), name="artifact-confirm"),
    path("datasets/<str:digest>/file", DatasetFileView.as_view(), name="dataset-file"),
    path("jobs/<str:job_id>/sessions", SessionReportView.as_view(), name="sessions"),
    path("jobs/<str:job_id>/registry-auth", images.RegistryAuthView.as_view(), name="registry-auth"),
    path("jobs/<str:job_id>/progress", images.ProgressView.as_view(), name="progress"),
]
