"""Real GPUs through NVML (nvidia-ml-py, module ``pynvml``).

Every field is read on its own: a GPU that does not support one reading
(``NVMLError_NotSupported``, common for power or ECC on consumer boards) still
reports the others. Xid errors come from an NVML event set, drained at each
sample, on the GPUs that support Xid events.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pynvml

from agents.probe import GpuInfo, GpuSample

log = logging.getLogger(__name__)

_MB = 1024 * 1024
# NVML reports a GPU that stopped answering as GpuIsLost; that is what Xid 79
# ("GPU has fallen off the bus") means, so the portal's health rules see it.
XID_FALLEN_OFF_BUS = 79
REPO = Path(__file__).resolve().parents[2]


def _process_name(pid: int) -> str:
    """The command name of a host process (what NVML reports are host pids), or "" if gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _components(n: int, linked) -> list[int]:
    """Each of n GPUs' group: the lowest index it is linked to, directly or through others."""
    group = list(range(n))
    for i in range(n):
        for j in range(i + 1, n):
            if group[j] != group[i] and linked(i, j):
                old, new = sorted((group[i], group[j]), reverse=True)
                group = [new if g == old else g for g in group]
    return group


def _numa_node(h, bus_id: str) -> int | None:
    try:
        node = pynvml.nvmlDeviceGetNumaNodeId(h)
    except (pynvml.NVMLError, AttributeError):  # older drivers / bindings: the kernel knows too
        try:
            node = int(Path(f"/sys/bus/pci/devices/{bus_id[-12:].lower()}/numa_node").read_text())
        except (OSError, ValueError):
            return None
    return node if node >= 0 else None


def read_topology(handles, bus_ids: list[str]) -> list[dict]:
    """Per GPU: its NVLink group (GPUs joined by NVLink peer-to-peer), PCIe switch (GPUs whose
    common PCIe ancestor is a switch, not a host bridge) and NUMA node. A level NVML cannot tell is
    None for every GPU: a topology the probe could not read only loses its placement hint."""
    n = len(handles)
    levels = {}
    checks = {
        "nvlink": lambda i, j: pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
        == pynvml.NVML_P2P_STATUS_OK,
        "pcie": lambda i, j: pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
        <= pynvml.NVML_TOPOLOGY_MULTIPLE,
    }
    for name, linked in checks.items():
        try:
            group = _components(n, linked)
        except Exception as exc:  # NVMLError, or a binding without the call
            log.warning("GPU topology: %s links unavailable (%s)", name, exc)
            group = None
        # No link at all says nothing about closeness: leave the level out rather than n singletons.
        levels[name] = group if group is not None and len(set(group)) < n else [None] * n
    numa = [_numa_node(h, b) for h, b in zip(handles, bus_ids)]
    return [{"nvlink": levels["nvlink"][i], "pcie": levels["pcie"][i], "numa": numa[i]} for i in range(n)]


class NvmlProbe:
    kind = "nvml"

    def __init__(self):
        pynvml.nvmlInit()  # raises NVMLError_LibraryNotFound / DriverNotLoaded without a driver
        self._lock = threading.Lock()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self._inventory = [self._info(i, h) for i, h in enumerate(self._handles)]
        try:
            topology = read_topology(self._handles, [g.pci_bus_id for g in self._inventory])
        except Exception as exc:  # the topology is a placement hint: never worth failing the agent for
            log.warning("GPU topology unavailable (%s)", exc)
        else:
            self._inventory = [dataclasses.replace(g, topology=t) for g, t in zip(self._inventory, topology)]
        self._uuid_by_index = {g.index: g.uuid for g in self._inventory}
        self._warned: set[tuple[str, str]] = set()
        self._events = self._register_xid_events()
        self._pending_xids: dict[str, list[int]] = {}
        log.info("NVML driver %s, %d GPU(s)", pynvml.nvmlSystemGetDriverVersion(), len(self._handles))

    @staticmethod
    def _info(index: int, h) -> GpuInfo:
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
        return GpuInfo(
            index=index,
            uuid=pynvml.nvmlDeviceGetUUID(h),
            model=pynvml.nvmlDeviceGetName(h),
            memory_mb=pynvml.nvmlDeviceGetMemoryInfo(h).total // _MB,
            pci_bus_id=bus_id,
        )

    def _register_xid_events(self):
        try:
            es = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("NVML event sets unavailable (%s): Xid errors will not be reported", exc)
            return None
        for g, h in zip(self._inventory, self._handles):
            try:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(h)
                if supported & pynvml.nvmlEventTypeXidCriticalError:
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
                else:
                    log.warning("GPU %s does not report Xid events", g.uuid)
            except pynvml.NVMLError as exc:
                log.warning("GPU %s: cannot register Xid events (%s)", g.uuid, exc)
        return es

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        while True:
            try:
                ev = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as exc:
                log.warning("NVML event wait failed: %s", exc)
                return
            if ev.eventType & pynvml.nvmlEventTypeXidCriticalError:
                try:
                    uuid = pynvml.nvmlDeviceGetUUID(ev.device)
                except pynvml.NVMLError:
                    uuid = "unknown"
                log.error("GPU %s reported Xid %d", uuid, ev.eventData)
                self._pending_xids.setdefault(uuid, []).append(int(ev.eventData))

    def _read(self, uuid: str, what: str, fn, *args):
        """One NVML reading, or None when this GPU cannot give it (logged once)."""
        try:
            return fn(*args)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError as exc:
            if (uuid, what) not in self._warned:
                self._warned.add((uuid, what))
                level = logging.DEBUG if isinstance(exc, pynvml.NVMLError_NotSupported) else logging.WARNING
                log.log(level, "GPU %s: %s unavailable (%s)", uuid, what, exc)
            return None

    def inventory(self) -> list[GpuInfo]:
        return list(self._inventory)

    def sample(self) -> list[GpuSample]:
        with self._lock:
            self._drain_xids()
            out = []
            for g, h in zip(self._inventory, self._handles):
                ts = time.time()
                try:
                    out.append(self._sample_one(g, h, ts))
                except pynvml.NVMLError_GpuIsLost:
                    log.error("GPU %s (%s) is lost", g.uuid, g.pci_bus_id)
                    out.append(GpuSample(
                        gpu_uuid=g.uuid, ts=ts, utilization=None, memory_used_mb=None,
                        memory_total_mb=g.memory_mb, temperature_c=None, power_w=None,
                        power_limit_w=None, ecc_errors=None,
                        xid_errors=self._pending_xids.pop(g.uuid, []) + [XID_FALLEN_OFF_BUS],
                    ))
            return out

    def _sample_one(self, g: GpuInfo, h, ts: float) -> GpuSample:
        u = g.uuid
        util = self._read(u, "utilization", pynvml.nvmlDeviceGetUtilizationRates, h)
        mem = self._read(u, "memory", pynvml.nvmlDeviceGetMemoryInfo, h)
        temp = self._read(u, "temperature", pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        power = self._read(u, "power", pynvml.nvmlDeviceGetPowerUsage, h)
        limit = self._read(u, "power limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        ecc = self._read(u, "ecc", pynvml.nvmlDeviceGetTotalEccErrors, h,
                         pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        procs = self._read(u, "processes", pynvml.nvmlDeviceGetComputeRunningProcesses, h) or []
        return GpuSample(
            gpu_uuid=u, ts=ts,
            utilization=None if util is None else int(util.gpu),
            memory_used_mb=None if mem is None else mem.used // _MB,
            memory_total_mb=g.memory_mb if mem is None else mem.total // _MB,
            temperature_c=temp,
            power_w=None if power is None else power / 1000.0,
            power_limit_w=None if limit is None else limit / 1000.0,
            ecc_errors=ecc,
            xid_errors=self._pending_xids.pop(u, []),
            processes=[
                {"pid": p.pid, "used_memory_mb": None if p.usedGpuMemory is None else p.usedGpuMemory // _MB}
                for p in procs
            ],
        )

    def scrub(self, gpu_indexes, timeout_s: float = 120.0) -> dict[int, str]:
        """Zero each GPU's free memory in a child process (agents/probe/cuda_scrub.py), all GPUs at once.

        A GPU still used by a process after its job's sandbox is gone has leaked
        to someone: it is not scrubbed but reported, and the portal drains the node.
        """
        failed, clean = {}, []
        for i in gpu_indexes:
            uuid = self._uuid_by_index[i]
            with self._lock:
                procs = self._read(uuid, "processes", pynvml.nvmlDeviceGetComputeRunningProcesses, self._handles[i])
            # The MPS control server of a shared GPU outlives its clients by design: not a leftover.
            procs = [p for p in procs or () if not _process_name(p.pid).startswith("nvidia-cuda-mps")]
            if procs:
                failed[i] = f"still used by process(es) {', '.join(str(p.pid) for p in procs)} after the job ended"
            else:
                clean.append(i)
        if clean:
            with ThreadPoolExecutor(max_workers=len(clean)) as pool:
                for i, why in zip(clean, pool.map(lambda i: self._scrub_one(i, timeout_s), clean)):
                    if why:
                        failed[i] = why
        return failed

    def _scrub_one(self, index: int, timeout_s: float) -> str | None:
        """One GPU's scrub; why it failed, or None."""
        uuid = self._uuid_by_index[index]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        try:
            r = subprocess.run([sys.executable, "-m", "agents.probe.cuda_scrub", "scrub"], env=env,
                               capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"memory scrub did not finish in {timeout_s:.0f}s"
        try:
            out = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out = {"error": (r.stderr or r.stdout).strip()[-300:] or f"exit status {r.returncode}"}
        if r.returncode or "error" in out:
            return f"memory scrub failed: {out.get('error')}"
        if out["zeroed_bytes"] < 0.9 * out["free_bytes"]:
            return f"memory scrub zeroed only {out['zeroed_bytes'] // _MB} MiB of {out['free_bytes'] // _MB} MiB free"
        log.info("GPU %s: zeroed %d MiB in %.2fs", uuid, out["zeroed_bytes"] // _MB, out["seconds"])
        return None

    def close(self) -> None:
        if self._events is not None:
            pynvml.nvmlEventSetFree(self._events)
            self._events = None
        pynvml.nvmlShutdown()
