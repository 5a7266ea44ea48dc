from django.urls import path

from .api import PrometheusView

app_name = "metrics"
urlpatterns = [path("", PrometheusView.as_view(), name="prometheus")]
