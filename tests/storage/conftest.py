import pytest


@pytest.fixture
def vision_volume(demo, volumes_root):
    from portal.core.context import Actor
    from portal.storage.services import volume_create

    return volume_create(actor=Actor(user=demo.users["alice"]), project=demo.vision, name="data")
