"""The job page's sessions (templates/jobs/detail.html): the jobs layer sits below interactive, so its
page asks for them through this tag rather than importing them (.importlinter)."""
from django import template

from portal.interactive.selectors import job_session_cards

register = template.Library()


@register.inclusion_tag("interactive/_job_sessions.html", takes_context=True)
def job_sessions(context, job):
    """The job's sessions the viewer may connect to: state, Connect, and the owner's sharing form."""
    user = context["request"].user
    return {"sessions": job_session_cards(user, job), "user": user, "job": job,
            "csrf_token": context.get("csrf_token")}
