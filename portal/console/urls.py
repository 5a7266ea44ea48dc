from django.urls import path

from .autoscaling import AutoscaleConsoleView
from .views import ConsoleView

app_name = "console"
urlpatterns = [path("", ConsoleView.as_view(), name="index"),
               path("autoscaling/", AutoscaleConsoleView.as_view(), name="autoscaling")]
