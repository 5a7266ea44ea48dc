from django.apps import AppConfig


class InteractiveConfig(AppConfig):
    # "sessions" is django.contrib.sessions' label: this app is "interactive".
    name = "portal.interactive"
    label = "interactive"
    verbose_name = "Interactive sessions"
