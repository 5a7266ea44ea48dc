#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (the `device` tool, when a task draws one):
#  1. the agent's NVML probe: inventory and a few samples as JSON, then the GPU topology it reads
#     (python -m agents.probe --gpus nvml; nvml, not auto: a silent fall-back
#     to simulated GPUs would hide exactly what this check is for);
#  2. the residue test of docs/reliability.md G-03 on GPU 0, through libcuda only
#     (agents/probe/cuda_scrub.py): tenant A fills GIB GiB with a pattern and
#     exits; tenant B scans as much fresh memory for it (informational: does
#     CUDA hand out old memory?); then A again, our scrub, and B again, which
#     must find 0 matches;
#  3. the agent's own scrub call (NvmlProbe.scrub) with its timing;
#  4. the kvm sandbox's passthrough check: every GPU's PCI address (from NVML) is an NVIDIA display
#     controller in sysfs, and its libvirt address keeps the whole PCI domain.
# Exit status is non-zero if NVML does not answer or the scrubbed scan finds the pattern.
#   bench/gpu_check.sh [SAMPLES] [INTERVAL_S] [GIB]    (defaults: 5 samples, 1 s apart, 8 GiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" -c 'import pynvml' 2>/dev/null || { echo "gpu_check: nvidia-ml-py (pynvml) is not installed for $PY" >&2; exit 1; }
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id,driver_version --format=csv >&2 || true
fi
"$PY" -m agents.probe --gpus nvml --samples "${1:-5}" --interval "${2:-1}"
echo "== topology the NVML probe reads (per GPU: nvlink group, pcie switch, numa node; nvidia-smi topo -m to compare)" >&2
"$PY" -c 'from agents.probe.nvml import NvmlProbe
for g in NvmlProbe().inventory(): print({"gpu": g.index, "pci_bus_id": g.pci_bus_id, "topology": g.topology})'
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi topo -m >&2 || true; fi
echo "== kvm passthrough: each GPU's PCI address is an NVIDIA GPU in sysfs" >&2
"$PY" - <<'EOF'
import pynvml as n
from agents.sandbox.kvm_domain import check_gpu, pci_address
n.nvmlInit()
for i in range(n.nvmlDeviceGetCount()):
    bus = n.nvmlDeviceGetPciInfo(n.nvmlDeviceGetHandleByIndex(i)).busId
    check_gpu(bus)
    print({"gpu": i, "pci_bus_id": bus, "libvirt_address": pci_address(bus)})
EOF

GIB="${3:-8}"
UUID="$("$PY" -c 'import pynvml as n; n.nvmlInit(); print(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(0)))')"
export CUDA_VISIBLE_DEVICES="$UUID"
PATTERN=0x5EC2E7A1
scrub() { "$PY" -m agents.probe.cuda_scrub "$@"; }
echo "== G-03 (a) no scrub between tenants: A fills, B scans" >&2
scrub fill "$PATTERN" --gib "$GIB"
scrub scan "$PATTERN" --gib "$GIB"
echo "== G-03 (b) with the scrub between them: must be 0 matches" >&2
scrub fill "$PATTERN" --gib "$GIB"
scrub scrub
after="$(scrub scan "$PATTERN" --gib "$GIB")"
echo "$after"
echo "== the agent's scrub of GPU 0 (NvmlProbe.scrub)" >&2
"$PY" - <<'EOF'
import logging, time
logging.basicConfig(level=logging.INFO)
from agents.probe.nvml import NvmlProbe
t0 = time.monotonic()
print({"failed": NvmlProbe().scrub([0]), "seconds": round(time.monotonic() - t0, 2)})
EOF
"$PY" -c 'import json,sys; m=json.loads(sys.argv[1])["matches"]; sys.exit(f"residue after scrub: {m} matches" if m else 0)' "$after"
