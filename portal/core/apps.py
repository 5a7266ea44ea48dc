from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "portal.core"
    label = "core"
    verbose_name = "Core"

    def ready(self):
        # Every Django process (web, workers, manage.py, tests) gets the portal's Celery app as the
        # current one, so shared tasks publish to the configured broker (portal/__init__.py says why
        # this is not done on import).
        import portal.celery  # noqa: F401
