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


def test_scrub_refuses_a_gpu_a_process_still_holds(nvml, monkeypatch):
    import subprocess

    ran = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: ran.append(a) or pytest.fail("must not scrub"))
    failed = NvmlProbe().scrub([0])
    assert failed == {0: "still used by process(es) 42, 43 after the job ended"} and ran == []


def test_scrub_without_a_cuda_driver_fails_and_says_why(nvml):
    # The real child process: this machine has no libcuda, which is exactly what a broken driver looks like.
    failed = NvmlProbe().scrub([1])
    assert "memory scrub failed: libcuda.so.1 cannot be loaded" in failed[1]


@pytest.mark.parametrize("zeroed,ok", [(79 * 1024 * MB, True), (10 * 1024 * MB, False)])
def test_scrub_checks_how_much_memory_the_child_zeroed(nvml, monkeypatch, zeroed, ok):
    # What the child prints on a real GPU (bench/gpu_check.sh runs it there); here only its verdict is checked.
    import json
    import subprocess

    def run(cmd, env, **kw):
        assert cmd[1:] == ["-m", "agents.probe.cuda_scrub", "scrub"] and env["CUDA_VISIBLE_DEVICES"] == "GPU-bbb"
        out = {"zeroed_bytes": zeroed, "free_bytes": 80 * 1024 * MB, "total_bytes": 81 * 1024 * MB, "seconds": 0.4}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(out) + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    failed = NvmlProbe().scrub([1])
    assert failed == ({} if ok else {1: "memory scrub zeroed only 10240 MiB of 81920 MiB free"})


def test_scrub_runs_one_child_per_gpu_at_once(nvml, monkeypatch):
    # Two GPUs ending together must not take twice as long: both children run before either returns.
    import json
    import subprocess
    import threading

    gate = threading.Barrier(2, timeout=10)
    seen = []

    def run(cmd, env, **kw):
        seen.append(env["CUDA_VISIBLE_DEVICES"])
        gate.wait()  # breaks (and the scrub fails) if the children ran one after the other
        out = {"zeroed_bytes": 80 * 1024 * MB, "free_bytes": 80 * 1024 * MB, "total_bytes": 81 * 1024 * MB,
               "seconds": 0.4}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(out) + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: [])
    assert NvmlProbe().scrub([0, 1]) == {} and sorted(seen) == ["GPU-aaa", "GPU-bbb"]


def test_scrub_does_not_count_the_mps_server_as_a_leftover(nvml, monkeypatch):
    import json
    import subprocess

    names = {42: "nvidia-cuda-mps", 43: "python3"}
    monkeypatch.setattr("agents.probe.nvml._process_name", lambda pid: names[pid])
    assert NvmlProbe().scrub([0]) == {0: "still used by process(es) 43 after the job ended"}
    names[43] = "nvidia-cuda-mps"  # only MPS servers left: the GPU is scrubbed
    out = {"zeroed_bytes": 1, "free_bytes": 1, "total_bytes": 2, "seconds": 0.1}
    monkeypatch.setattr(subprocess, "run", lambda cmd, env, **kw: subprocess.CompletedProcess(
        cmd, 0, json.dumps(out), ""))
    assert NvmlProbe().scrub([0]) == {}


def test_topology_groups_nvlink_peers_and_reads_numa_nodes(nvml, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetP2PStatus", lambda a, b, cap: pynvml.NVML_P2P_STATUS_OK
                        if cap == pynvml.NVML_P2P_CAPS_INDEX_NVLINK else 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTopologyCommonAncestor", lambda a, b: pynvml.NVML_TOPOLOGY_SYSTEM)

    def numa(h):
        if h.i == 1:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # and no such PCI device in this machine's sysfs
        return 1
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", numa)
    inv = NvmlProbe().inventory()
    # Both on one NVLink; no PCIe switch shared (their common ancestor is the system): not reported.
    assert [g.topology for g in inv] == [{"nvlink": 0, "pcie": None, "numa": 1},
                                         {"nvlink": 0, "pcie": None, "numa": None}]
    assert inv[0].as_dict()["topology"] == {"nvlink": 0, "pcie": None, "numa": 1}


def test_a_topology_nvml_cannot_read_is_left_out_and_the_probe_still_starts(nvml, monkeypatch):
    def broken(*a):
        raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
    for name in ("nvmlDeviceGetP2PStatus", "nvmlDeviceGetNumaNodeId"):
        monkeypatch.setattr(pynvml, name, broken)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTopologyCommonAncestor", lambda a, b: pynvml.NVML_TOPOLOGY_SINGLE)
    inv = NvmlProbe().inventory()
    assert [g.topology for g in inv] == [{"nvlink": None, "pcie": 0, "numa": None}] * 2
    assert len(NvmlProbe().sample()) == 2
