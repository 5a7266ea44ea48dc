"""A throwaway PostgreSQL database for a benchmark, on the server DATABASE_URL names.

Each benchmark uses its own database name, so it never clobbers a test run's `test_*` database.
"""
import sys
from contextlib import contextmanager


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
