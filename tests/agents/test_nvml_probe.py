"""NvmlProbe against a fake NVML (no machine here has a driver; bench/gpu_check.sh
is the check on real hardware)."""

from types import SimpleNamespace as NS

import pynvml
import pytest

from agents.probe.nvml import NvmlProbe

MB = 1024 * 1024


def err(code):
    return pynvml.NVMLError(code)  # NVMLError.__new__ returns the matching subclass


@pytest.fixture
def nvml(monkeypatch):
    """Two GPUs: 0 supports everything, 1 (a consumer board) has no power or ECC readings."""
    state = NS(events=[], lost=set(), xid_supported={0})
    devs = [NS(i=0, uuid="GPU-aaa", name="NVIDIA H100 80GB HBM3", bus="00000000:18:00.0"),
            NS(i=1, uuid="GPU-bbb", name="NVIDIA GeForce RTX 4090", bus="00000000:3B:00.0")]

    def check(h):
        if h.i in state.lost:
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return h

    def unsupported_on_1(value):
        def fn(h, *a):
            if check(h).i == 1:
                raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return value
        return fn

    def wait(es, timeout_ms):
        if not state.events:
            raise err(pynvml.NVML_ERROR_TIMEOUT)
        return state.events.pop(0)

    fns = dict(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: "580.1",
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: devs[i],
        nvmlDeviceGetPciInfo=lambda h: NS(busId=h.bus), nvmlDeviceGetUUID=lambda h: h.uuid,
        nvmlDeviceGetName=lambda h: h.name,
        nvmlDeviceGetMemoryInfo=lambda h: NS(total=80 * 1024 * MB, used=check(h).i * 1000 * MB + 500 * MB, free=0),
        nvmlDeviceGetUtilizationRates=lambda h: NS(gpu=check(h).i * 50 + 7, memory=3),
        nvmlDeviceGetTemperature=lambda h, s: 40 + check(h).i,
        nvmlDeviceGetPowerUsage=unsupported_on_1(123456),
        nvmlDeviceGetEnforcedPowerLimit=unsupported_on_1(700000),
        nvmlDeviceGetTotalEccErrors=unsupported_on_1(2),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [NS(pid=42, usedGpuMemory=2048 * MB),
                                                        NS(pid=43, usedGpuMemory=None)] if check(h).i == 0 else [],
        nvmlEventSetCreate=lambda: "es", nvmlEventSetFree=lambda es: None, nvmlEventSetWait_v2=wait,
        nvmlDeviceGetSupportedEventTypes=lambda h: pynvml.nvmlEventTypeXidCriticalError
        if h.i in state.xid_supported else 0,
        nvmlDeviceRegisterEvents=lambda h, types, es: None,
    )
    for k, v in fns.items():
        monkeypatch.setattr(pynvml, k, v)
    state.devs = devs
    return state


def test_inventory(nvml):
    inv = NvmlProbe().inventory()
    assert [(g.index, g.uuid, g.memory_mb, g.pci_bus_id) for g in inv] == [
        (0, "GPU-aaa", 81920, "00000000:18:00.0"), (1, "GPU-bbb", 81920, "00000000:3B:00.0")]
    assert inv[0].model == "NVIDIA H100 80GB HBM3"


def test_sample_reads_every_field_and_tolerates_not_supported(nvml):
    s0, s1 = NvmlProbe().sample()
    assert (s0.utilization, s0.memory_used_mb, s0.memory_total_mb, s0.temperature_c) == (7, 500, 81920, 40)
    assert (s0.power_w, s0.power_limit_w, s0.ecc_errors) == (123.456, 700.0, 2)
    assert s0.processes == [{"pid": 42, "used_memory_mb": 2048}, {"pid": 43, "used_memory_mb": None}]
    assert (s1.utilization, s1.memory_used_mb, s1.temperature_c) == (57, 1500, 41)
    assert (s1.power_w, s1.power_limit_w, s1.ecc_errors) == (None, None, None)


def test_xid_events_are_reported_once_on_their_gpu(nvml):
    p = NvmlProbe()
    nvml.events += [NS(device=nvml.devs[0], eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=48)]
    s0, s1 = p.sample()
    assert s0.xid_errors == [48] and s1.xid_errors == []
    assert p.sample()[0].xid_errors == []


def test_lost_gpu_reads_as_xid_79(nvml):
    p = NvmlProbe()
    nvml.lost.add(1)
    s0, s1 = p.sample()
    assert s0.utilization == 7
    assert s1.utilization is None and s1.xid_errors == [79]
