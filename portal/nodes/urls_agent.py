from django.urls import path

from . import agent_api

app_name = "agent"
urlpatterns = [
    path("register", agent_api.RegisterView.as_view(), name="register"),
    path("heartbeat", agent_api.HeartbeatView.as_view(), name="heartbeat"),
    path("probe", agent_api.ProbeView.as_view(), name="probe"),
    path("jobs/<str:job_id>/confirm", agent_api.ConfirmView.as_view(), name="confirm"),
    path("jobs/<str:job_id>/events", agent_api.EventView.as_view(), name="events"),
    path("jobs/<str:job_id>/logs", agent_api.LogView.as_view(), name="logs"),
]
