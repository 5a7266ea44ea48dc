"""Gives each pytest-xdist worker its own Redis databases and var directory.

Loaded with ``-p tests.workers`` (pytest.ini), so it runs while pytest parses
its arguments: before pytest-env and pytest-django read the environment and
before Django imports its settings. pytest-django already gives each worker
its own PostgreSQL database (``test_<name>_gw0``, ...); this does the same for
what the settings read from the environment:

- ``CELERY_BROKER_URL`` and ``REDIS_URL`` on Redis move to databases of their
  own: worker ``gwN`` takes ``2 + 2N`` (broker) and ``3 + 2N`` (cache), so a
  plain run (``/0`` and ``/1``) and up to seven workers fit in Redis's 16;
- ``GPUPORTAL_VAR_DIR`` gets the worker's name as a suffix.

A run without xdist (``-p no:xdist`` or ``-n 0``) is left as it is.
"""
import os
import re

_WORKER = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))


def _redis_db(url: str, db: int) -> str:
    if not url.startswith(("redis://", "rediss://")):
        return url
    base, _, query = url.partition("?")
    base = re.sub(r"/\d*$", "", base)
    return f"{base}/{db}" + (f"?{query}" if query else "")


if _WORKER:
    n = int(_WORKER.group(1))
    if 3 + 2 * n > 15:
        raise SystemExit(f"tests/workers.py: worker gw{n} has no Redis databases left (at most 7 workers)")
    for name, db in (("CELERY_BROKER_URL", 2 + 2 * n), ("REDIS_URL", 3 + 2 * n)):
        if name in os.environ:
            os.environ[name] = _redis_db(os.environ[name], db)
    os.environ["GPUPORTAL_VAR_DIR"] = f"{os.environ.get('GPUPORTAL_VAR_DIR', 'var/test')}-gw{n}"
