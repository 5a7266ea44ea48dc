"""Simulated GPUs for development and CI.

The numbers follow what the agent says runs where (``set_busy``) so dashboards,
idle detection and health rules can be exercised without hardware. Tests steer
faults through ``inject_temperature``, ``inject_xid``, ``inject_ecc`` and
``inject_scrub_failure``. A GPU a job ran on holds "residue" until it is
scrubbed, so tests can see that the agent clears every GPU it hands back.
"""

from __future__ import annotations

import math
import random
import re
import threading
import time
import uuid

from agents.probe import GpuInfo, GpuSample

# Board power limits in watts for models people will type; anything else gets
# a generic 300 W. Used only to make the simulated power numbers plausible.
_POWER_LIMIT_W = {"H100": 700.0, "H200": 700.0, "A100": 400.0, "L40S": 350.0, "V100": 300.0}
_SPEC_RE = re.compile(r"^(?P<count>\d+)x(?P<model>[A-Za-z0-9]+)-(?P<mem>\d+)GB$")

IDLE_TEMP_C = 32.0
BUSY_TEMP_C = 68.0


class SimProbe:
    kind = "sim"

    def __init__(self, spec: str = "8xH100-80GB", *, node_name: str = "node", seed: int | None = None,
                 clock=time.time):
        m = _SPEC_RE.match(spec)
        if not m:
            raise ValueError(f"simulated GPU spec must look like 8xH100-80GB, got {spec!r}")
        count, model, mem_gb = int(m["count"]), m["model"], int(m["mem"])
        if not 1 <= count <= 64:
            raise ValueError(f"simulated GPU count must be 1..64, got {count}")
        self._clock = clock
        self._rng = random.Random(seed if seed is not None else node_name)
        self._lock = threading.Lock()
        self._power_limit = _POWER_LIMIT_W.get(model.upper(), 300.0)
        self._gpus = [
            GpuInfo(
                index=i,
                # Stable per (node, index): re-registering the same node keeps its GPUs.
                uuid="GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpuportal-sim/{node_name}/{i}")),
                model=f"NVIDIA {model} {mem_gb}GB",
                memory_mb=mem_gb * 1024,
                # Spread over buses the way 8-GPU boards are: one GPU per PCIe switch.
                pci_bus_id=f"{i // 8:08X}:{0x18 + 0x10 * (i % 8):02X}:00.0",
                # An 8-GPU board in the shape of HGX: two NVLink groups of 4, each on its own CPU
                # socket (NUMA node), two GPUs per PCIe switch.
                topology={"nvlink": i // 4 * 4, "pcie": i // 2 * 2, "numa": i // 4},
            )
            for i in range(count)
        ]
        self._busy = [False] * count
        self._temp = [IDLE_TEMP_C] * count
        self._temp_override: dict[int, float] = {}
        self._pending_xids: dict[int, list[int]] = {}
        self._ecc = [0] * count
        self._residue = [False] * count  # memory a job wrote and nobody has cleared
        self._scrub_failures: dict[int, str] = {}
        self._last_ts = clock()

    # -- what the agent and tests tell us ---------------------------------

    def set_busy(self, gpu_indexes, busy: bool) -> None:
        with self._lock:
            for i in gpu_indexes:
                self._check(i)
                self._busy[i] = busy
                self._residue[i] = self._residue[i] or busy

    def inject_temperature(self, index: int, temperature_c: float | None) -> None:
        """Pin a GPU's temperature (a hot GPU); ``None`` lets it follow load again."""
        with self._lock:
            self._check(index)
            if temperature_c is None:
                self._temp_override.pop(index, None)
            else:
                self._temp_override[index] = float(temperature_c)

    def inject_xid(self, index: int, xid: int = 79) -> None:
        """Queue an Xid for the next sample (79: GPU has fallen off the bus)."""
        with self._lock:
            self._check(index)
            self._pending_xids.setdefault(index, []).append(int(xid))

    def inject_ecc(self, index: int, count: int = 1) -> None:
        with self._lock:
            self._check(index)
            self._ecc[index] += count

    def inject_scrub_failure(self, index: int, message: str = "simulated scrub failure") -> None:
        """Make the next scrub of this GPU fail (its memory stays as it was)."""
        with self._lock:
            self._check(index)
            self._scrub_failures[index] = message

    def residue(self, index: int) -> bool:
        """Whether a job's memory is still on this GPU."""
        with self._lock:
            return self._residue[index]

    def _check(self, index: int) -> None:
        if not 0 <= index < len(self._gpus):
            raise IndexError(f"no simulated GPU {index} (have {len(self._gpus)})")

    # -- Probe interface ----------------------------------------------------

    def inventory(self) -> list[GpuInfo]:
        return list(self._gpus)

    def scrub(self, gpu_indexes) -> dict[int, str]:
        failed = {}
        with self._lock:
            for i in gpu_indexes:
                self._check(i)
                if self._busy[i]:
                    failed[i] = "still in use by a job"
                elif i in self._scrub_failures:
                    failed[i] = self._scrub_failures.pop(i)
                else:
                    self._residue[i] = False
        return failed

    def sample(self) -> list[GpuSample]:
        with self._lock:
            now = self._clock()
            dt = max(0.0, now - self._last_ts)
            self._last_ts = now
            # First-order thermal lag, time constant ~30 s: a GPU warms up over a
            # minute or so after a job lands instead of jumping.
            alpha = 1.0 - math.exp(-dt / 30.0)
            out = []
            for gpu in self._gpus:
                i, busy, r = gpu.index, self._busy[gpu.index], self._rng
                target = BUSY_TEMP_C if busy else IDLE_TEMP_C
                self._temp[i] += (target - self._temp[i]) * alpha
                temp = self._temp_override.get(i, self._temp[i] + r.uniform(-0.5, 0.5))
                if busy:
                    util = r.randint(85, 100)
                    used = int(gpu.memory_mb * r.uniform(0.6, 0.9))
                    power = self._power_limit * r.uniform(0.6, 0.92)
                    procs = [{"pid": 10000 + i, "used_memory_mb": used - 500}]
                else:
                    util = 0
                    used = r.randint(0, 16)
                    power = self._power_limit * r.uniform(0.09, 0.11)
                    procs = []
                out.append(GpuSample(
                    gpu_uuid=gpu.uuid, ts=now, utilization=util, memory_used_mb=used,
                    memory_total_mb=gpu.memory_mb, temperature_c=int(round(temp)),
                    power_w=round(power, 1), power_limit_w=self._power_limit,
                    ecc_errors=self._ecc[i], xid_errors=self._pending_xids.pop(i, []),
                    processes=procs,
                ))
            return out
