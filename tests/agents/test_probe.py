import logging

import pytest

from agents.probe import GpuSample, make_probe
from agents.probe.sim import SimProbe


class FakeClock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def test_sim_inventory_follows_the_spec():
    gpus = SimProbe("4xA100-40GB", node_name="n1").inventory()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert all(g.memory_mb == 40 * 1024 and "A100" in g.model for g in gpus)
    assert len({g.uuid for g in gpus}) == 4 and all(g.uuid.startswith("GPU-") for g in gpus)
    assert len({g.pci_bus_id for g in gpus}) == 4


def test_sim_uuids_are_stable_per_node_and_differ_between_nodes():
    a1 = SimProbe("2xH100-80GB", node_name="a").inventory()
    a2 = SimProbe("2xH100-80GB", node_name="a").inventory()
    b = SimProbe("2xH100-80GB", node_name="b").inventory()
    assert [g.uuid for g in a1] == [g.uuid for g in a2]
    assert not {g.uuid for g in a1} & {g.uuid for g in b}


@pytest.mark.parametrize("bad", ["8xH100", "H100-80GB", "0xH100-80GB", "8x-80GB"])
def test_sim_rejects_bad_specs(bad):
    with pytest.raises(ValueError):
        SimProbe(bad)


def test_sim_metrics_follow_busy_gpus():
    """What the portal reads from a probe (idle detection, node pages, health): a busy GPU shows
    load and a process, an idle one none, every figure stays within NVML's ranges, and a released
    GPU goes back to idle. (The simulated figures themselves are invented: not asserted.)"""
    clock = FakeClock()
    p = SimProbe("2xH100-80GB", node_name="n", clock=clock)

    def in_range(s):
        return (0 <= s.utilization <= 100 and 0 <= s.memory_used_mb <= s.memory_total_mb
                and 0 <= s.power_w <= s.power_limit_w and s.memory_total_mb == 80 * 1024)

    idle = p.sample()
    assert all(s.utilization == 0 and s.processes == [] and in_range(s) for s in idle)
    p.set_busy([1], True)
    for _ in range(20):  # ten simulated minutes
        clock.t += 30
        samples = p.sample()
        assert all(in_range(s) for s in samples)
    s0, s1 = samples
    assert s0.utilization == 0 and s0.processes == []
    assert s1.utilization > 0 and s1.processes
    assert s1.memory_used_mb > s0.memory_used_mb and s1.power_w > s0.power_w and s1.temperature_c > s0.temperature_c
    busy = s1
    p.set_busy([1], False)
    for _ in range(20):
        clock.t += 30
        s1 = p.sample()[1]
    assert s1.utilization == 0 and s1.processes == [] and s1.temperature_c < busy.temperature_c and in_range(s1)


def test_sim_fault_injection_hot_gpu_xid_and_ecc():
    p = SimProbe("2xH100-80GB", node_name="n")
    p.inject_temperature(0, 95)
    p.inject_xid(1, 79)
    p.inject_ecc(1, 2)
    s0, s1 = p.sample()
    assert s0.temperature_c == 95
    assert s1.xid_errors == [79] and s1.ecc_errors == 2
    # An Xid is reported once; ECC counts are cumulative like NVML's.
    s0, s1 = p.sample()
    assert s1.xid_errors == [] and s1.ecc_errors == 2 and s0.temperature_c == 95
    p.inject_temperature(0, None)
    assert p.sample()[0].temperature_c < 50
    with pytest.raises(IndexError):
        p.inject_xid(5)


def test_sample_serialises_to_plain_json_types():
    import json

    d = SimProbe("1xH100-80GB").sample()[0].as_dict()
    assert set(d) == {f for f in GpuSample.__dataclass_fields__}
    json.dumps(d)


def _no_driver(monkeypatch):
    """Make NVML fail the way it does on a machine without a driver, on any machine."""
    import pynvml

    def init():
        raise pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", init)


def test_make_probe_auto_falls_back_to_sim_and_says_so(monkeypatch, caplog):
    _no_driver(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="agents.probe"):
        p = make_probe("auto", node_name="n")
    assert p.kind == "sim" and len(p.inventory()) == 8
    assert "FALLING BACK TO SIMULATED GPUs" in caplog.text and "NVML" in caplog.text


def test_make_probe_nvml_fails_without_a_driver(monkeypatch):
    import pynvml

    _no_driver(monkeypatch)
    with pytest.raises(pynvml.NVMLError):
        make_probe("nvml")


def test_make_probe_sim_and_bad_option():
    assert len(make_probe("sim:2xH100-80GB").inventory()) == 2
    with pytest.raises(ValueError):
        make_probe("cuda")


def test_sim_reports_an_hgx_like_topology():
    topo = [g.topology for g in SimProbe("8xH100-80GB", node_name="n").inventory()]
    assert [t["nvlink"] for t in topo] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [t["pcie"] for t in topo] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert [t["numa"] for t in topo] == [0, 0, 0, 0, 1, 1, 1, 1]
