from django.urls import path

from .views import ConsoleView

app_name = "console"
urlpatterns = [path("", ConsoleView.as_view(), name="index")]
