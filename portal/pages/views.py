import json

from django import forms
from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views import View
from django.views.generic import ListView

from portal.core.errors import ServiceError
from portal.core.pages import PageMixin, refused, scoped_or_404
from portal.interactive.selectors import session_cards
from portal.jobs.models import JobTemplate
from portal.jobs.selectors import jobs_for_list
from portal.jobs.services import template_delete, template_save
from portal.storage.artifacts import project_artifact_totals
from portal.tenancy.access import user_can
from portal.tenancy.models import ROLE_RANK, Membership, Project, Role
from portal.tenancy.selectors import artifact_retention_days, projects_for_home
from portal.tenancy.services import membership_add, membership_change_role, membership_remove

from .selectors import quota_usage

DASHBOARD_JOBS = 10


class HomeView(LoginRequiredMixin, ListView):
    """The dashboard: my active and recently finished jobs, and each project's quota bars."""

    template_name = "tenancy/home.html"
    context_object_name = "projects"

    def get_queryset(self):
        return projects_for_home(user=self.request.user)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        user = self.request.user
        context["usage"] = quota_usage(context["projects"])
        context["active_jobs"] = list(jobs_for_list(user=user, state="active", mine=True)[:DASHBOARD_JOBS])
        context["finished_jobs"] = list(jobs_for_list(user=user, state="finished", mine=True)
                                        .order_by("-ended_at", "-id")[:DASHBOARD_JOBS])
        context["sessions"] = session_cards(user)
        return context


# The project page: members and roles, quota and usage, job templates.


class MemberAddForm(forms.Form):
    username = forms.CharField(max_length=150, label="Username")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER, label="Role")


class TemplateForm(forms.Form):
    name = forms.CharField(max_length=100, label="Name")
    description = forms.CharField(max_length=500, required=False, label="Description")
    spec = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), label="Spec (JSON)", initial="{}",
                           help_text='Job spec fields, e.g. {"image": "gpuportal/python:3.11", '
                                     '"resources": {"gpus": 1}}.')
    locked = forms.CharField(required=False, max_length=300, label="Locked fields",
                             help_text="Spec fields a submit may not change, separated by commas.")

    def clean_spec(self):
        try:
            spec = json.loads(self.cleaned_data["spec"] or "{}")
        except ValueError as exc:
            raise forms.ValidationError(f"Not valid JSON: {exc}.") from None
        if not isinstance(spec, dict):
            raise forms.ValidationError("Expected a JSON object.")
        return spec

    def clean_locked(self):
        return [f.strip() for f in self.cleaned_data["locked"].split(",") if f.strip()]


def _project(request, slug):
    return scoped_or_404(Project.objects.select_related("organization", "quota"), request, slug=slug)


def project_page(request, project, *, add_form=None, template_form=None):
    user = request.user
    members = sorted(Membership.objects.for_user(user, "view").filter(project=project).select_related("user"),
                     key=lambda m: (-ROLE_RANK.get(m.role, 0), m.user.username))
    return render(request, "tenancy/project.html", {
        "project": project,
        "my_role": next((m.role for m in members if m.user_id == user.pk), None),
        "members": members,
        "roles": Role.choices,
        "can_manage": user_can(user, "manage", project),
        "can_submit": user_can(user, "submit", project),
        "usage": quota_usage([project])[0],
        "artifacts": {**project_artifact_totals(project), "retention_days": artifact_retention_days(project)},
        "templates": JobTemplate.objects.for_user(user, "view").filter(project=project).order_by("name"),
        "add_form": add_form or MemberAddForm(),
        "template_form": template_form or TemplateForm(),
    })


class ProjectDetailView(PageMixin, View):
    def get(self, request, slug):
        return project_page(request, _project(request, slug))


class MemberAddView(PageMixin, View):
    def post(self, request, slug):
        project = _project(request, slug)
        form = MemberAddForm(request.POST)
        if form.is_valid():
            try:
                membership_add(actor=self.actor, project=project, **form.cleaned_data)
            except ServiceError as exc:
                if exc.status == 403:
                    return refused(request, exc, back=project_url(project))
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                messages.success(request, f"{form.cleaned_data['username']} added as {form.cleaned_data['role']}.")
                return redirect(project_url(project))
        return project_page(request, project, add_form=form)


def _membership(request, slug, username):
    return scoped_or_404(Membership.objects.select_related("project", "user"), request,
                         project__slug=slug, user__username=username)


def project_url(project) -> str:
    return reverse("projects:detail", args=[project.slug])


class MemberRoleView(PageMixin, View):
    def post(self, request, slug, username):
        membership = _membership(request, slug, username)
        back = project_url(membership.project)
        try:
            membership = membership_change_role(actor=self.actor, membership=membership,
                                                role=request.POST.get("role", ""))
        except ServiceError as exc:
            return refused(request, exc, back=back)
        messages.success(request, f"{username} is now {membership.role}.")
        return redirect(back)


class MemberRemoveView(PageMixin, View):
    def post(self, request, slug, username):
        membership = _membership(request, slug, username)
        project = membership.project
        try:
            membership_remove(actor=self.actor, membership=membership)
        except ServiceError as exc:
            return refused(request, exc, back=project_url(project))
        if membership.user_id == request.user.pk:
            messages.success(request, f"You left {project.slug}.")
            return redirect("home")
        messages.success(request, f"{username} removed from {project.slug}.")
        return redirect(project_url(project))


class TemplateAddView(PageMixin, View):
    def post(self, request, slug):
        project = _project(request, slug)
        form = TemplateForm(request.POST)
        if form.is_valid():
            try:
                template_save(actor=self.actor, project=project, **form.cleaned_data)
            except ServiceError as exc:
                if exc.status == 403:
                    return refused(request, exc, back=project_url(project))
                if exc.fields:
                    for name, texts in exc.as_fields().items():
                        form.add_error("spec", f"{name}: {texts[0]}")
                else:
                    form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                messages.success(request, f"Template {form.cleaned_data['name']} saved.")
                return redirect(project_url(project))
        return project_page(request, project, template_form=form)


class TemplateDeleteView(PageMixin, View):
    def post(self, request, slug, pk):
        template = scoped_or_404(JobTemplate.objects.select_related("project"), request, pk=pk, project__slug=slug)
        try:
            template_delete(actor=self.actor, template=template)
        except ServiceError as exc:
            return refused(request, exc, back=project_url(template.project))
        messages.success(request, f"Template {template.name} deleted.")
        return redirect(project_url(template.project))
