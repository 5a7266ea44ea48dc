from django.contrib.auth import views as auth_views
from django.urls import include, path

from . import views

# The tokens page, namespaced: tokens:list, tokens:revoke.
token_pages = [
    path("", views.TokenListView.as_view(), name="list"),
    path("<int:pk>/revoke/", views.TokenRevokeView.as_view(), name="revoke"),
]

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("tokens/", include((token_pages, "tokens"))),
]
