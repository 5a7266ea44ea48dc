from django.test import Client

from portal.core.models import AuditEvent


def test_login_and_logout(demo, settings):
    client = Client()
    r = client.post("/login/", {"username": "alice", "password": settings.DEMO_PASSWORD})
    assert r.status_code == 302 and r["Location"] == "/"
    page = client.get("/")
    assert page.status_code == 200
    assert b"vision" in page.content and b"owner" in page.content and b"nlp" not in page.content
    assert AuditEvent.objects.filter(action="user.login", actor_label="alice").exists()
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302


def test_login_requires_csrf(demo, settings):
    client = Client(enforce_csrf_checks=True)
    r = client.post("/login/", {"username": "alice", "password": settings.DEMO_PASSWORD})
    assert r.status_code == 403


def test_login_is_throttled_after_repeated_failures(demo, settings):
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        r = client.post("/login/", {"username": "alice", "password": "wrong"})
        assert r.status_code == 200  # the form again, with an error
    r = client.post("/login/", {"username": "alice", "password": "wrong"})
    assert r.status_code == 429  # the failure that reaches the limit locks
    # Locked: even the right password is refused now.
    r = client.post("/login/", {"username": "alice", "password": settings.DEMO_PASSWORD})
    assert r.status_code == 429
    assert b"Too many failed logins" in r.content
    # Another user from the same address is not locked out by alice's failures.
    r = client.post("/login/", {"username": "bob", "password": settings.DEMO_PASSWORD})
    assert r.status_code == 302


def test_session_api_write_needs_csrf(demo):
    from django.contrib.auth import get_user_model

    client = Client(enforce_csrf_checks=True)
    client.force_login(get_user_model().objects.get(username="alice"))
    r = client.patch("/api/v1/projects/vision/", data={"description": "x"}, content_type="application/json")
    assert r.status_code == 403
    assert "CSRF" in r.json()["error"]["message"]
