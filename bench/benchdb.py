"""What every portal benchmark starts with: the portal set up (`django_setup`) and a throwaway
PostgreSQL database on the server DATABASE_URL names (`throwaway_database`).

A benchmark is run as `python bench/<name>.py`, so this folder is on sys.path and it imports this
module first. Each benchmark uses its own database name, so it never clobbers a test run's
`test_*` database.
"""
import os
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Production settings, for what measures CPU or memory (DEBUG off: no query log, which would cost
# CPU of its own), with the secret key and hosts they require.
PRODUCTION = {"DEBUG": "0", "LOG_LEVEL": "WARNING", "SECRET_KEY": "bench-" + "abcdefghij" * 6,
              "ALLOWED_HOSTS": "testserver,127.0.0.1,localhost"}
# Development settings, for what measures queries and passes.
DEVELOPMENT = {"DEBUG": "1"}


def django_setup(settings: dict[str, str], **more: str) -> None:
    """Make the repository importable, put `settings` and then `more` in the environment where it
    does not already name them (so a run can override any), and set up Django."""
    sys.path.insert(0, str(ROOT))
    for key, value in {"DJANGO_SETTINGS_MODULE": "portal.settings", **settings, **more}.items():
        os.environ.setdefault(key, value)
    import django

    django.setup()


@contextmanager
def throwaway_database(name: str):
    from django.db import connection

    if connection.vendor != "postgresql":
        sys.exit("Set DATABASE_URL to a PostgreSQL server.")
    old = connection.settings_dict["NAME"]
    connection.settings_dict.setdefault("TEST", {})["NAME"] = name
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False, serialize=False)
    try:
        yield connection.settings_dict["NAME"]
    finally:
        connection.creation.destroy_test_db(old, verbosity=0)


def backend_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds the PostgreSQL backend `pid` (by default this process's connection's) has used,
    or None when the server is not on this machine: on a loaded machine wall times stretch with
    the load, CPU times do not."""
    if pid is None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

