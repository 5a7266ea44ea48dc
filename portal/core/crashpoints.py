"""Test-only crash points (reliability notes section 3).

`crashpoint("schedule.after_snapshot")` kills the current process with SIGKILL when
settings.TESTING_CRASHPOINTS is on and GPUPORTAL_CRASHPOINT names that point, so
tests can prove that a worker dying at that instant loses nothing. Off in production.
"""
import os
import signal

from django.conf import settings


def crashpoint(name: str) -> None:
    if settings.TESTING_CRASHPOINTS and os.environ.get("GPUPORTAL_CRASHPOINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
