import pytest


@pytest.fixture(autouse=True)
def _fresh_gpu_maps():
    """Each test starts without the per-process GPU maps and sample buffer of earlier tests."""
    from portal.metrics import services

    services._GPU_MAPS.clear()
    services.BUFFER.drain()
    yield
    services._GPU_MAPS.clear()
    services.BUFFER.drain()
