"""The sharing form of an interactive session (docs/sessions.md section 2): on the owner's session
card, it says who may connect and changes it through the same service as
PATCH /api/v1/sessions/<id>/. Only the job's owner reaches it: anyone else gets 404."""
import re

from django import forms
from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.views import View

from portal.core.errors import ServiceError
from portal.core.pages import PageMixin, refused
from portal.interactive.models import Session
from portal.interactive.services import session_share

MAX_USERS = 50


class SessionShareForm(forms.Form):
    share = forms.ChoiceField(choices=[("owner", "Only me"), ("project", "Everyone in the job's project")],
                              widget=forms.RadioSelect, error_messages={"required": "Choose who may connect."})
    users = forms.CharField(required=False, max_length=4000, label="Also these people",
                            help_text="Usernames in this job's organization, separated by commas or spaces; "
                                      "empty: nobody by name.")

    def clean_users(self) -> list[str]:
        names = list(dict.fromkeys(n for n in re.split(r"[\s,]+", self.cleaned_data["users"]) if n))
        if len(names) > MAX_USERS:
            raise forms.ValidationError(f"At most {MAX_USERS} people.")
        if any(len(n) > 150 for n in names):
            raise forms.ValidationError("A username has at most 150 characters.")
        return names


def owned_session(request, pk) -> Session:
    """The session if the person is its job's owner, else 404 (members it is shared with, staff and
    other tenants alike: the form is the owner's)."""
    session = (Session.objects.for_user(request.user, "view").filter(pk=pk, job__user=request.user)
               .select_related("job__project").prefetch_related("shared_users").first())
    if session is None:
        raise Http404("No session here.")
    return session


def shared_names(session: Session) -> list[str]:
    return sorted(u.username for u in session.shared_users.all())


def share_context(session: Session, form: SessionShareForm | None = None, saved: bool = False,
                  back: str = "") -> dict:
    return {"s": session, "form": form, "saved": saved, "names": shared_names(session), "back": back,
            "share_value": form.data.get("share", "") if form is not None else session.share,
            "users_value": form.data.get("users", "") if form is not None else ", ".join(shared_names(session))}


def back_to(request) -> str:
    """Where the form came from: "job" (the job page's card), else the dashboard."""
    return "job" if request.POST.get("back", request.GET.get("back")) == "job" else ""


class SessionShareView(PageMixin, View):
    """GET: the form (a page of its own without htmx); POST: save it. htmx swaps the card's part.
    The dashboard's cards and the job page's both carry it; ``back=job`` returns to the job page."""

    def get(self, request, pk):
        return self._render(request, share_context(owned_session(request, pk), back=back_to(request)))

    def post(self, request, pk):
        session = owned_session(request, pk)
        back = back_to(request)
        form = SessionShareForm(request.POST)
        if form.is_valid():
            try:
                session = session_share(actor=self.actor, session=session, share=form.cleaned_data["share"],
                                        users=form.cleaned_data["users"])
            except ServiceError as exc:
                if exc.status == 403:
                    return refused(request, exc, back="/")
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                session = owned_session(request, pk)  # its saved sharing, freshly read
                if not request.htmx:
                    messages.success(request, f"Sharing of {session.name} (job {session.job_id}) saved.")
                    return redirect("jobs:detail", session.job_id) if back else redirect("home")
                return self._render(request, share_context(session, saved=True, back=back))
        return self._render(request, share_context(session, form, back=back))

    def _render(self, request, ctx):
        return render(request, "interactive/_share.html" if request.htmx else "interactive/share.html", ctx)
