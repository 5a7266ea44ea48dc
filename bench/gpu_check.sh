#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the agent's NVML probe and print the
# inventory and a few samples as JSON (python -m agents.probe --gpus nvml).
# --gpus nvml, not auto: on a GPU machine a silent fall-back to simulated
# GPUs would hide exactly what this check is for. Exit status is non-zero if
# NVML does not answer.
#   bench/gpu_check.sh [SAMPLES] [INTERVAL_S]     (defaults: 5 samples, 1 s apart)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" -c 'import pynvml' 2>/dev/null || { echo "gpu_check: nvidia-ml-py (pynvml) is not installed for $PY" >&2; exit 1; }
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id,driver_version --format=csv >&2 || true
fi
exec "$PY" -m agents.probe --gpus nvml --samples "${1:-5}" --interval "${2:-1}"
