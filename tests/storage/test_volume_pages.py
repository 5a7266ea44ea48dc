"""The volumes pages: create, upload, browse, download, delete, as a browser posts them."""
from django.core.files.uploadedfile import SimpleUploadedFile

from portal.storage.models import Volume


def _login(client, demo, username):
    client.force_login(demo.users[username])
    return client


def test_a_file_uploaded_on_the_page_is_listed_and_downloads(client, demo, volumes_root):
    _login(client, demo, "alice")
    response = client.post("/projects/vision/volumes/", {"name": "data", "quota_mb": 10})
    assert response.status_code == 302
    volume = Volume.objects.get(project=demo.vision, name="data")
    page = client.get("/projects/vision/volumes/")
    assert b"/data/data" in page.content and b"<script>" not in page.content
    upload = SimpleUploadedFile("notes.txt", b"hello volume\n")
    response = client.post(f"/projects/vision/volumes/{volume.pk}/upload/?path=docs", {"file": upload})
    assert response.status_code == 302 and response["Location"].endswith("?path=docs")
    assert (volumes_root / "acme/vision/data/docs/notes.txt").read_bytes() == b"hello volume\n"
    top = client.get(f"/projects/vision/volumes/{volume.pk}/")
    assert b"docs/" in top.content
    folder = client.get(f"/projects/vision/volumes/{volume.pk}/?path=docs")
    assert b"notes.txt" in folder.content and b"download/?path=docs/notes.txt" in folder.content
    got = client.get(f"/projects/vision/volumes/{volume.pk}/download/?path=docs/notes.txt")
    assert got.status_code == 200 and b"".join(got.streaming_content) == b"hello volume\n"
    assert "attachment" in got["Content-Disposition"]


def test_bad_names_and_paths_are_refused_with_a_message(client, demo, volumes_root):
    _login(client, demo, "alice")
    response = client.post("/projects/vision/volumes/", {"name": "../etc", "quota_mb": 10})
    assert response.status_code == 400 and not Volume.objects.exists()
    client.post("/projects/vision/volumes/", {"name": "data", "quota_mb": 10})
    volume = Volume.objects.get()
    assert client.get(f"/projects/vision/volumes/{volume.pk}/?path=../../..").status_code == 302
    upload = SimpleUploadedFile("x.txt", b"x")
    response = client.post(f"/projects/vision/volumes/{volume.pk}/upload/?path=../..", {"file": upload}, follow=True)
    assert b"may not contain" in response.content
    assert sorted(p.name for p in volumes_root.rglob("x.txt")) == []


def test_viewers_cannot_upload_and_outsiders_see_nothing(client, demo, vision_volume):
    _login(client, demo, "dave")
    upload = SimpleUploadedFile("x.txt", b"x")
    assert client.post(f"/projects/vision/volumes/{vision_volume.pk}/upload/", {"file": upload}).status_code == 403
    assert b"Upload a file" not in client.get(f"/projects/vision/volumes/{vision_volume.pk}/").content
    _login(client, demo, "charlie")
    for url in ("", f"{vision_volume.pk}/", f"{vision_volume.pk}/download/?path=x"):
        assert client.get(f"/projects/vision/volumes/{url}").status_code == 404
    assert client.post(f"/projects/vision/volumes/{vision_volume.pk}/delete/").status_code == 404
    assert Volume.objects.filter(pk=vision_volume.pk).exists()
