import atexit
import logging

from django.apps import AppConfig


class MetricsConfig(AppConfig):
    name = "portal.metrics"
    label = "metrics"
    verbose_name = "GPU metrics"

    def ready(self):
        atexit.register(_flush_at_exit)


def _flush_at_exit() -> None:
    """A process stopping cleanly writes the samples it buffered."""
    try:
        from .services import BUFFER, samples_flush  # apps.py loads before the models: not at its top

        if BUFFER.rows:
            samples_flush()
    except Exception:  # the database may already be gone at exit; samples are informational
        logging.getLogger(__name__).warning("could not write buffered GPU samples at exit", exc_info=True)
