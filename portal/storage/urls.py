from django.urls import path

from . import views

# Under projects/<slug>/volumes/, namespaced: volumes:list, volumes:browse, ...
urlpatterns = [
    path("", views.VolumeListView.as_view(), name="list"),
    path("<int:pk>/", views.VolumeBrowseView.as_view(), name="browse"),
    path("<int:pk>/upload/", views.VolumeUploadView.as_view(), name="upload"),
    path("<int:pk>/download/", views.VolumeDownloadView.as_view(), name="download"),
    path("<int:pk>/delete/", views.VolumeDeleteView.as_view(), name="delete"),
]
