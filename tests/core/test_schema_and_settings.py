import os
import subprocess
import sys

import yaml
from django.conf import settings

EXPECTED_PATHS = {
    "/api/v1/me/": {"get"},
    "/api/v1/me/notifications/": {"get", "patch"},
    "/api/v1/organizations/": {"get", "post"},
    "/api/v1/organizations/{slug}/": {"get"},
    "/api/v1/projects/": {"get", "post"},
    "/api/v1/projects/{slug}/": {"get", "patch"},
    "/api/v1/projects/{slug}/quota/": {"get", "patch"},
    "/api/v1/projects/{project_slug}/members/": {"get", "post"},
    "/api/v1/projects/{project_slug}/members/{username}/": {"get", "patch", "delete"},
    "/api/v1/tokens/": {"get", "post"},
    "/api/v1/tokens/{id}/": {"get", "delete"},
}


def test_openapi_schema_builds_and_lists_endpoints(db, client):
    r = client.get("/api/schema/")
    assert r.status_code == 200
    schema = yaml.safe_load(r.content)
    assert schema["openapi"].startswith("3.")
    for path, methods in EXPECTED_PATHS.items():
        assert path in schema["paths"], path
        assert methods <= set(schema["paths"][path]), (path, set(schema["paths"][path]))


def test_schema_generation_has_no_warnings():
    r = subprocess.run([sys.executable, "manage.py", "spectacular", "--fail-on-warn", "--file", os.devnull],
                       capture_output=True, text=True, cwd=settings.BASE_DIR, env={**os.environ, "DEBUG": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


def test_docs_are_served_without_cdn(db, client):
    r = client.get("/api/docs/")
    assert r.status_code == 200
    html = r.content.decode()
    assert "cdn" not in html.lower() and "unpkg" not in html and "jsdelivr" not in html
    assert "/static/drf_spectacular_sidecar/" in html


def _manage(*args, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS")}
    return subprocess.run([sys.executable, "manage.py", *args], capture_output=True, text=True,
                          cwd=settings.BASE_DIR, env={**base, **env})


def test_check_deploy_is_clean_in_production_settings():
    r = _manage("check", "--deploy", "--fail-level", "WARNING",
                DEBUG="0", SECRET_KEY="x7Kq2-" * 10, ALLOWED_HOSTS="gpu.example.com")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no issues" in r.stdout


def test_bad_configuration_names_the_variable():
    r = _manage("check", DEBUG="0")
    assert r.returncode != 0 and "SECRET_KEY" in r.stderr
    r = _manage("check", DEBUG="maybe")
    assert r.returncode != 0 and "DEBUG" in r.stderr
    r = _manage("check", DEBUG="1", DATABASE_URL="nosuchdb://x")
    assert r.returncode != 0 and "DATABASE_URL" in r.stderr
    r = _manage("check", DEBUG="1", CELERY_BROKER_URL="kafka://x")
    assert r.returncode != 0 and "CELERY_BROKER_URL" in r.stderr
    r = _manage("check", DEBUG="0", SECRET_KEY="short")
    assert r.returncode != 0 and "SECRET_KEY" in r.stderr
    r = _manage("check", DEBUG="1", MAX_REQUEST_BYTES="lots")
    assert r.returncode != 0 and "MAX_REQUEST_BYTES" in r.stderr
