"""GPU probes: what GPUs this node has and how they are doing.

Two implementations share one interface: ``NvmlProbe`` reads a real driver
through NVML, ``SimProbe`` makes up plausible numbers for development and CI.
``make_probe`` picks one from the ``--gpus`` option.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_SIM = "8xH100-80GB"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as registered with the portal (identity does not change)."""

    index: int
    uuid: str
    model: str
    memory_mb: int
    pci_bus_id: str
    # Interconnect domains within the node, {"nvlink": id, "pcie": id, "numa": id} (an id: the
    # lowest GPU index in that domain, or the NUMA node; None where not known). None: not read.
    topology: dict | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class GpuSample:
    """One reading of one GPU. A field the GPU does not support is None.

    ``ecc_errors`` is the volatile (since driver load) count of uncorrected
    errors: corrected ones are routine and must not mark a GPU unhealthy.
    ``xid_errors`` lists the Xid codes seen since the previous sample, so the
    portal can tell a GPU fault (48, 79, ...) from an application one (13, 43).
    ``processes`` is ``[{"pid": int, "used_memory_mb": int | None}]``.
    """

    gpu_uuid: str
    ts: float
    utilization: int | None
    memory_used_mb: int | None
    memory_total_mb: int | None
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    ecc_errors: int | None
    xid_errors: list[int] = field(default_factory=list)
    processes: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class Probe(Protocol):
    kind: str  # "nvml" or "sim", reported in logs and at registration

    def inventory(self) -> list[GpuInfo]: ...

    def sample(self) -> list[GpuSample]: ...

    def scrub(self, gpu_indexes) -> dict[int, str]:
        """Clear the memory of GPUs no job uses any more, before another tenant gets them.
        Returns ``{index: why it failed}`` for those that could not be cleared."""
        ...


def make_probe(option: str = "auto", *, node_name: str = "node") -> Probe:
    """Build the probe named by ``--gpus``.

    ``auto``: NVML when a driver answers, else simulated GPUs (``DEFAULT_SIM``)
    with a warning, so a laptop runs the whole stack. ``nvml``: NVML or fail.
    ``sim:<N>x<MODEL>-<MEM>GB``: simulated, UUIDs derived from ``node_name`` so
    two simulated nodes never share a GPU UUID.
    """
    from agents.probe.sim import SimProbe

    if option.startswith("sim:"):
        return SimProbe(option[4:], node_name=node_name)
    if option not in ("auto", "nvml"):
        raise ValueError(f"--gpus: expected auto, nvml or sim:<N>x<MODEL>-<MEM>GB, got {option!r}")
    try:
        from agents.probe.nvml import NvmlProbe

        probe = NvmlProbe()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
        if option == "nvml":
            raise
        log.warning(
            "GPU probe: NVML did not answer (%s: %s); FALLING BACK TO SIMULATED GPUs "
            "sim:%s. Metrics and GPUs reported by this agent are not real.",
            type(exc).__name__, exc, DEFAULT_SIM,
        )
        return SimProbe(DEFAULT_SIM, node_name=node_name)
    log.info("GPU probe: NVML, %d GPU(s)", len(probe.inventory()))
    return probe
