from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from portal.core.context import Actor
from portal.core.errors import ServiceError
from portal.tenancy.models import Project

from ...services import token_issue


class Command(BaseCommand):
    help = "Create an API token for USERNAME and print it once."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--scopes", default="read,submit", help="comma-separated: read,submit,admin")
        parser.add_argument("--project", help="restrict the token to this project slug")
        parser.add_argument("--expires-days", type=int, default=None)
        parser.add_argument("--name", default="cli")

    def handle(self, *args, username, scopes, project, expires_days, name, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"No user named {username!r}.")
        restricted = None
        if project:
            restricted = Project.objects.for_user(user, "view").filter(slug=project).first()
            if restricted is None:
                raise CommandError(f"--project: {username} has no project named {project!r}.")
        try:
            _, secret = token_issue(
                actor=Actor(user=user, label="manage.py"), user=user, name=name,
                scopes=[s.strip() for s in scopes.split(",") if s.strip()],
                project=restricted, expires_days=expires_days,
            )
        except ServiceError as exc:
            raise CommandError(f"--{(exc.field or 'scopes').replace('_', '-')}: {exc.message}") from None
        self.stdout.write(secret)
