"""Project volumes through the API: roles, tenancy, uploads and downloads, and bad paths."""
import os

import pytest

from portal.core.models import AuditEvent
from portal.storage.models import Volume
from tests.conftest import make_token


def _upload(client, volume, path, body: bytes):
    return client.put(f"/api/v1/volumes/{volume.pk}/files/?path={path}", data=body,
                      content_type="application/octet-stream")


def test_owner_creates_a_volume_with_a_folder_owned_by_the_project(api, demo, volumes_root):
    response = api("alice").post("/api/v1/volumes/", {"project": "vision", "name": "data", "quota_mb": 5},
                                 format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["mount_path"] == "/data/data"
    folder = volumes_root / "acme" / "vision" / "data"
    st = os.stat(folder)
    assert st.st_mode & 0o777 == 0o770
    assert st.st_uid == st.st_gid == 2000000 + demo.vision.pk
    assert os.stat(volumes_root / "acme" / "vision").st_mode & 0o777 == 0o770
    assert AuditEvent.objects.filter(action="volume.create").count() == 1
    # The same name twice in one project: a field message, not a 500.
    again = api("alice").post("/api/v1/volumes/", {"project": "vision", "name": "data"}, format="json")
    assert again.status_code == 400 and "name" in again.json()["error"]["fields"]


@pytest.mark.parametrize("body,field", [
    ({"project": "vision", "name": "../x"}, "name"),
    ({"project": "vision", "name": "Data"}, "name"),
    ({"project": "vision", "name": "a\x00b"}, "name"),
    ({"project": "vision", "name": "x", "quota_mb": 0}, "quota_mb"),
    ({"project": "nlp", "name": "x"}, "project"),
    ({"project": "vision", "name": "x", "path": "/etc"}, "path"),
])
def test_bad_volume_bodies_are_refused_by_field(api, demo, volumes_root, body, field):
    response = api("alice").post("/api/v1/volumes/", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["fields"]
    assert not Volume.objects.exists()


def test_members_upload_viewers_read_outsiders_see_nothing(api, demo, vision_volume, volumes_root):
    assert _upload(api("bob"), vision_volume, "in/train.csv", b"a,b\n1,2\n").status_code == 201
    assert (volumes_root / "acme/vision/data/in/train.csv").read_bytes() == b"a,b\n1,2\n"
    assert os.stat(volumes_root / "acme/vision/data/in/train.csv").st_uid == 2000000 + demo.vision.pk
    listing = api("dave").get(f"/api/v1/volumes/{vision_volume.pk}/files/?path=in").json()
    assert listing["entries"] == [{"name": "train.csv", "type": "file", "size": 8,
                                   "modified": listing["entries"][0]["modified"]}]
    top = api("dave").get(f"/api/v1/volumes/{vision_volume.pk}/files/").json()
    assert [e["name"] for e in top["entries"]] == ["in"]
    download = api("dave").get(f"/api/v1/volumes/{vision_volume.pk}/download/?path=in/train.csv")
    assert download.status_code == 200 and b"".join(download.streaming_content) == b"a,b\n1,2\n"
    assert download["Content-Type"] == "application/octet-stream"
    assert _upload(api("dave"), vision_volume, "x.txt", b"x").status_code == 403
    for url in ("", "files/", "download/?path=in/train.csv"):
        assert api("charlie").get(f"/api/v1/volumes/{vision_volume.pk}/{url}").status_code == 404
    assert _upload(api("charlie"), vision_volume, "x.txt", b"x").status_code == 404
    assert api("charlie").delete(f"/api/v1/volumes/{vision_volume.pk}/").status_code == 404
    assert api("charlie").get("/api/v1/volumes/").json()["results"] == []
    assert not (volumes_root / "acme/vision/data/x.txt").exists()


@pytest.mark.parametrize("path", ["../escape", "a/../../x", "/etc/passwd", "a\\b", "bad%01name", "%00", ""])
def test_bad_paths_are_400_on_path(api, demo, vision_volume, volumes_root, path):
    response = _upload(api("alice"), vision_volume, path, b"x")
    assert response.status_code in (400, 404), response.content
    if response.status_code == 400 and path != "%00":
        assert "path" in response.json()["error"]["fields"], response.json()
    download = api("alice").get(f"/api/v1/volumes/{vision_volume.pk}/download/?path={path}")
    assert download.status_code in (400, 404)
    assert sorted(p.name for p in (volumes_root / "acme").iterdir()) == ["vision"]


def test_symlinks_are_never_followed(api, demo, vision_volume, volumes_root, tmp_path):
    """A job may plant a symlink to another tenant's folder: browse, download and upload refuse it."""
    secret = tmp_path / "other-tenant"
    secret.mkdir()
    (secret / "key").write_text("secret")
    data = volumes_root / "acme/vision/data"
    os.symlink(secret, data / "link")
    os.symlink(secret / "key", data / "keylink")
    client = api("alice")
    assert client.get(f"/api/v1/volumes/{vision_volume.pk}/files/?path=link").status_code == 400
    response = client.get(f"/api/v1/volumes/{vision_volume.pk}/download/?path=keylink")
    assert response.status_code == 400 and "path" in response.json()["error"]["fields"]
    assert client.get(f"/api/v1/volumes/{vision_volume.pk}/download/?path=link/key").status_code == 400
    assert _upload(client, vision_volume, "link/new", b"x").status_code == 400
    assert _upload(client, vision_volume, "keylink", b"x").status_code == 400
    assert sorted(p.name for p in secret.iterdir()) == ["key"] and (secret / "key").read_text() == "secret"
    listing = client.get(f"/api/v1/volumes/{vision_volume.pk}/files/").json()["entries"]
    assert {e["name"]: e["type"] for e in listing} == {"link": "symlink", "keylink": "symlink"}


def test_upload_limit_is_413_and_quota_is_413_leaving_nothing(api, demo, volumes_root, settings):
    from portal.core.context import Actor
    from portal.storage.services import volume_create

    settings.VOLUME_UPLOAD_MAX_MB = 1
    volume = volume_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="small", quota_mb=2)
    client = api("alice")
    response = _upload(client, volume, "big", b"x" * (1024 * 1024 + 1))
    assert response.status_code == 413 and "upload limit" in response.json()["error"]["message"]
    assert _upload(client, volume, "a", b"x" * (1024 * 1024)).status_code == 201
    assert _upload(client, volume, "b", b"x" * (1024 * 1024)).status_code == 201
    response = _upload(client, volume, "c", b"x" * 10)
    assert response.status_code == 413 and response.json()["error"]["code"] == "volume_quota_exceeded"
    assert "quota of 2 MB" in response.json()["error"]["message"]
    assert sorted(os.listdir(volumes_root / "acme/vision/small")) == ["a", "b"]  # no temporary file left
    # Replacing a file counts its old size as free.
    assert _upload(client, volume, "b", b"y" * (1024 * 1024)).status_code == 201


def test_only_owners_and_admins_delete_and_the_folder_goes(api, demo, vision_volume, volumes_root):
    _upload(api("alice"), vision_volume, "f", b"1")
    assert api("bob").delete(f"/api/v1/volumes/{vision_volume.pk}/").status_code == 403
    assert api("alice").delete(f"/api/v1/volumes/{vision_volume.pk}/").status_code == 204
    assert not (volumes_root / "acme/vision/data").exists()
    assert not Volume.objects.exists()


def test_restricted_token_sees_only_its_project(api, demo, vision_volume):
    from portal.tenancy.models import Organization
    from portal.tenancy.services import membership_add, project_create
    from portal.core.context import Actor

    staff = Actor(user=demo.users["admin"])
    audio = project_create(actor=staff, organization=Organization.objects.get(slug="acme"), slug="audio", name="A")
    membership_add(actor=staff, project=audio, username="alice", role="owner")
    client = api(token=make_token(demo.users["alice"], ["read", "submit", "admin"], project=audio))
    assert client.get("/api/v1/volumes/").json()["results"] == []
    assert client.get(f"/api/v1/volumes/{vision_volume.pk}/files/").status_code == 404
    assert _upload(client, vision_volume, "x", b"x").status_code == 404
    response = client.post("/api/v1/volumes/", {"project": "vision", "name": "v2"}, format="json")
    assert response.status_code == 400 and "project" in response.json()["error"]["fields"]
    assert client.post("/api/v1/volumes/", {"project": "audio", "name": "v2"}, format="json").status_code == 201
