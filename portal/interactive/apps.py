from django.apps import AppConfig


class InteractiveConfig(AppConfig):
    # "sessions" is django.contrib.sessions' label: this app is "interactive".
    name = "portal.interactive"
    label = "interactive"
    verbose_name = "Interactive sessions"

    def ready(self):
        # Jobs sits below interactive: a new job's ports become its sessions through this registration.
        # Imported here, not at the top: apps.py loads before the models are ready (Django's rule).
        from portal.jobs.submit_hooks import register

        from .services import job_sessions_create

        register(self.label, created=job_sessions_create)
