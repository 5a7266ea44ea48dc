from django.apps import AppConfig


class StorageConfig(AppConfig):
    name = "portal.storage"
    label = "storage"
    verbose_name = "Storage"

    def ready(self):
        # Jobs sits below storage: it checks a spec's volumes and datasets through this registration.
        # Imported here, not at the top: apps.py loads before the models are ready (Django's rule).
        from portal.jobs.submit_hooks import register

        from .job_spec import job_spec_errors

        register(self.label, spec_check=job_spec_errors)
