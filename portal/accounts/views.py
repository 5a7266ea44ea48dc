"""The tokens page: create (the secret is shown once), list, revoke."""
from django import forms
from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views import View

from portal.core.errors import ServiceError
from portal.core.pages import PageMixin, refused, scoped_or_404
from portal.tenancy.models import Project

from .models import ApiToken, Scope
from .services import token_issue, token_revoke


class TokenCreateForm(forms.Form):
    name = forms.CharField(max_length=100, label="Name", help_text="What it is for, e.g. 'laptop CLI' or 'CI'.")
    scopes = forms.MultipleChoiceField(choices=Scope.choices, widget=forms.CheckboxSelectMultiple, label="Scopes",
                                       initial=[Scope.READ, Scope.SUBMIT])
    project = forms.ChoiceField(required=False, label="Only for project",
                                help_text="Optional: the token then sees and acts on this project only.")
    expires_days = forms.IntegerField(min_value=1, label="Expires after (days)")

    def __init__(self, *args, projects=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.projects = {p.slug: p for p in projects}
        self.fields["project"].choices = [("", "All my projects")] + [(s, s) for s in self.projects]
        self.fields["expires_days"].max_value = settings.TOKEN_MAX_EXPIRY_DAYS
        self.fields["expires_days"].widget.attrs["max"] = settings.TOKEN_MAX_EXPIRY_DAYS
        self.fields["expires_days"].initial = settings.TOKEN_DEFAULT_EXPIRY_DAYS


class TokenListView(PageMixin, View):
    def _render(self, request, form, created=None, secret=None):
        tokens = ApiToken.objects.for_user(request.user).select_related("project")
        response = render(request, "accounts/tokens.html",
                          {"form": form, "tokens": tokens, "created": created, "secret": secret})
        if secret:
            response["Cache-Control"] = "no-store"  # the secret must not linger in a cache
        return response

    def _projects(self, request):
        return Project.objects.for_user(request.user, "view").order_by("slug")

    def get(self, request):
        return self._render(request, TokenCreateForm(projects=self._projects(request)))

    def post(self, request):
        form = TokenCreateForm(request.POST, projects=self._projects(request))
        if not form.is_valid():
            return self._render(request, form)
        d = form.cleaned_data
        try:
            token, secret = token_issue(actor=self.actor, user=request.user, name=d["name"], scopes=d["scopes"],
                                        project=form.projects.get(d["project"]), expires_days=d["expires_days"])
        except ServiceError as exc:
            form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            return self._render(request, form)
        # Rendered, not redirected: the secret is shown in this response only and stored nowhere.
        return self._render(request, TokenCreateForm(projects=self._projects(request)), created=token, secret=secret)


class TokenRevokeView(PageMixin, View):
    def post(self, request, pk):
        token = scoped_or_404(ApiToken, request, pk=pk)
        try:
            token_revoke(actor=self.actor, token=token)
        except ServiceError as exc:
            return refused(request, exc, back=reverse("tokens:list"))
        messages.success(request, f"Token {token.name} ({token.prefix}…) revoked.")
        return redirect("tokens:list")
