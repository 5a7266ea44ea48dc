from django.urls import path

from . import views

# Under projects/<slug>/datasets/, namespaced: datasets:list.
urlpatterns = [
    path("", views.DatasetListView.as_view(), name="list"),
]
