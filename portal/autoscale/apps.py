from django.apps import AppConfig


class AutoscaleConfig(AppConfig):
    name = "portal.autoscale"
    label = "autoscale"
    verbose_name = "Node pools and autoscaling"

    def ready(self):
        # An AppConfig loads before the models: what imports them waits for ready().
        from scheduler.adapter import REASON_NOTES

        from .services import waiting_notes

        if waiting_notes not in REASON_NOTES:
            REASON_NOTES.append(waiting_notes)
