#!/bin/bash
# gpuportal beside Slurm on this machine, one command: 1,000 one-GPU `true` jobs on 16 nodes x 8
# simulated GPUs, submitted by one serial client, on each side in turn; prints both and the ratios.
#
#   bench/vs_slurm.sh /path/to/slurm-bench-scripts [jobs]
#
# The Slurm side needs a folder with the setup.sh / bench.sh / stop.sh scripts of a single-host
# Slurm 22.05 benchmark (16 slurmd with gres gpu:8, slurmctld with high-throughput settings,
# PROFILE=tuned; bench.sh prints one JSON line whose phases.sbatch holds submit_rate_jobs_s,
# makespan_s and cpu_s.slurmctld). It is given as the first argument or SLURM_BENCH_DIR; without
# it only the portal side runs. The portal side is bench/vs_portal.py (an installation of its own,
# process sandbox, the portal's default timers). Each side takes a few minutes of both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
SLURM_DIR=${1:-${SLURM_BENCH_DIR:-}}
JOBS=${2:-1000}
OUT=$(mktemp -d /tmp/vs-slurm.XXXXXX)

if [ -n "$SLURM_DIR" ]; then
  echo "== Slurm: $JOBS x sbatch --gres=gpu:1 --wrap true (tuned profile)" >&2
  (cd "$SLURM_DIR" && PROFILE=tuned ./setup.sh >&2)
  (cd "$SLURM_DIR" && N_HELD=0 N_MIX=0 N_ARRAY=0 PROBES=0 SRUN_PROBES=0 N_SBATCH="$JOBS" ./bench.sh) \
    | tail -n 1 > "$OUT/slurm.json" || true
  (cd "$SLURM_DIR" && ./stop.sh >&2) || true
fi

echo "== gpuportal: $JOBS x POST /api/v1/jobs/" >&2
.venv/bin/python bench/vs_portal.py --jobs "$JOBS" | tail -n 1 > "$OUT/portal.json"

.venv/bin/python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
portal = json.loads((out / "portal.json").read_text())
slurm = None
if (out / "slurm.json").exists() and (out / "slurm.json").read_text().strip():
    slurm = json.loads((out / "slurm.json").read_text())["phases"]["sbatch"]

jobs = portal["jobs"]
rows = [("makespan (s)", portal["makespan_s"], slurm and slurm["makespan_s"]),
        ("serial submit rate (jobs/s)", portal["submit_rate_jobs_s"], slurm and slurm["submit_rate_jobs_s"]),
        ("control-plane CPU per job (ms)", portal["cpu_ms_per_job"]["control"],
         slurm and round(slurm["cpu_s"]["slurmctld"] * 1000 / jobs, 1)),
        ("node-side CPU per job (ms)", portal["cpu_ms_per_job"]["agents"],
         slurm and round(slurm["cpu_s"]["slurmd_all"] * 1000 / jobs, 1)),
        # Each job's supervisor and the job; Slurm's bench counts no slurmstepd.
        ("job supervisor + job CPU per job (ms)", portal["cpu_ms_per_job"].get("jobs"), None)]
print(f"{jobs} one-GPU `true` jobs, 16 nodes x 8 GPUs; gpuportal {portal['succeeded']} succeeded"
      + (f", Slurm {slurm['completed']} completed" if slurm else " (Slurm side not run)"))
print(f"| | gpuportal | Slurm | gpuportal / Slurm |\n|---|---|---|---|")
for name, ours, theirs in rows:
    ratio = f"{ours / theirs:.2f}" if theirs and ours is not None else "-"
    print(f"| {name} | {ours} | {theirs if theirs is not None else '-'} | {ratio} |")
print(f"(raw JSON in {out})")
EOF
