"""Per-project registry credentials: owners and admins set and delete them, the secret is stored
encrypted and never returned, outsiders see nothing (404), and no job's environment holds it."""
import pytest

from portal.core.models import AuditEvent
from portal.jobs.models import Job
from portal.storage import secrets
from portal.storage.models import RegistryCredential

URL = "/api/v1/registry-credentials/"
BODY = {"project": "vision", "registry": "registry.example.org:5000", "username": "ci", "secret": "p@ss w0rd!"}


@pytest.fixture
def alice(demo, api):
    return api("alice")


def test_an_owner_sets_a_credential_whose_secret_is_never_returned(alice, api):
    r = alice.post(URL, BODY, format="json")
    assert r.status_code == 201, r.content
    created = r.json()
    assert "secret" not in created and "p@ss" not in r.content.decode()
    assert (created["registry"], created["username"], created["created_by"]) == ("registry.example.org:5000", "ci",
                                                                                 "alice")
    row = RegistryCredential.objects.get()
    assert "p@ss" not in row.secret_encrypted and secrets.decrypt(row.secret_encrypted) == "p@ss w0rd!"
    for reader in (alice, api("bob"), api("dave")):
        for response in (reader.get(URL), reader.get(f"{URL}{created['id']}/")):
            assert response.status_code == 200 and "p@ss" not in response.content.decode()
    assert reader.get(f"{URL}{created['id']}/").json()["username"] == "ci"
    event = AuditEvent.objects.get(action="registry_credential.set")
    assert "p@ss" not in str(event.__dict__)


def test_setting_the_same_registry_again_replaces_the_login(alice):
    alice.post(URL, BODY, format="json")
    r = alice.post(URL, {**BODY, "username": "robot", "secret": "new"}, format="json")
    assert r.status_code == 201, r.content
    row = RegistryCredential.objects.get()
    assert row.username == "robot" and secrets.decrypt(row.secret_encrypted) == "new"


def test_members_and_viewers_may_not_set_or_delete(alice, api):
    cred = alice.post(URL, BODY, format="json").json()
    for name in ("bob", "dave"):
        assert api(name).post(URL, {**BODY, "registry": "ghcr.io"}, format="json").status_code == 403
        assert api(name).delete(f"{URL}{cred['id']}/").status_code == 403
    assert RegistryCredential.objects.count() == 1
    assert alice.delete(f"{URL}{cred['id']}/").status_code == 204
    assert not RegistryCredential.objects.exists()


def test_outsiders_see_nothing(alice, api):
    cred = alice.post(URL, BODY, format="json").json()
    charlie = api("charlie")
    listing = charlie.get(URL)
    assert listing.status_code == 200 and "registry.example.org" not in listing.content.decode()
    assert charlie.get(f"{URL}{cred['id']}/").status_code == 404
    assert charlie.delete(f"{URL}{cred['id']}/").status_code == 404
    r = charlie.post(URL, {**BODY, "registry": "ghcr.io"}, format="json")
    assert r.status_code == 400 and "project" in r.json()["error"]["fields"]
    assert RegistryCredential.objects.count() == 1


@pytest.mark.parametrize("field, value", [
    ("registry", "https://registry.example.org"), ("registry", "registry.example.org/team"), ("registry", ""),
    ("registry", "Registry.Example.org"), ("registry", "host:port"), ("username", ""), ("secret", ""),
    ("secret", "x" * 4097), ("project", "nlp"),
])
def test_bad_input_is_a_400_naming_the_field(alice, field, value):
    r = alice.post(URL, {**BODY, field: value}, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert not RegistryCredential.objects.exists()


def test_the_secret_is_not_in_a_jobs_environment(alice):
    alice.post(URL, BODY, format="json")
    r = alice.post("/api/v1/jobs/", {"project": "vision", "image": "gpuportal/busybox:latest", "command": ["env"]},
                   format="json")
    assert r.status_code == 201, r.content
    job = Job.objects.get()
    assert "p@ss" not in str(job.env) and "p@ss" not in r.content.decode()
