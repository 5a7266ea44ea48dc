from django.urls import include, path

from . import sessions, views
from .views import HomeView

# Project pages, namespaced: projects:detail, projects:member-add, ...
project_pages = [
    path("<slug:slug>/", views.ProjectDetailView.as_view(), name="detail"),
    path("<slug:slug>/members/", views.MemberAddView.as_view(), name="member-add"),
    path("<slug:slug>/members/<str:username>/role/", views.MemberRoleView.as_view(), name="member-role"),
    path("<slug:slug>/members/<str:username>/remove/", views.MemberRemoveView.as_view(), name="member-remove"),
    path("<slug:slug>/templates/", views.TemplateAddView.as_view(), name="template-add"),
    path("<slug:slug>/templates/<int:pk>/delete/", views.TemplateDeleteView.as_view(), name="template-delete"),
]

urlpatterns = [
    path("", HomeView.as_view(), name="home"),
    path("projects/", include((project_pages, "projects"))),
    # Not under /sessions/: the ASGI proxy takes that prefix (portal/asgi.py).
    path("session-sharing/<int:pk>/", sessions.SessionShareView.as_view(), name="session-share"),
]
