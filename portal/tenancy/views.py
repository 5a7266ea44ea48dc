from django.contrib.auth.mixins import LoginRequiredMixin
from django.views.generic import ListView

from .selectors import projects_for_home


class HomeView(LoginRequiredMixin, ListView):
    """The projects one may see, with role and quota."""

    template_name = "tenancy/home.html"
    context_object_name = "projects"

    def get_queryset(self):
        return projects_for_home(user=self.request.user)
