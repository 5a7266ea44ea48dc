#!/bin/bash
# gpuportal beside Slurm on this machine, one command: 1,000 one-GPU `true` jobs on 16 nodes x 8
# simulated GPUs, submitted by one serial client, on each side in turn; prints both and the ratios.
#
#   bench/vs_slurm.sh /path/to/slurm-bench-scripts [jobs] [rounds]
#
# The Slurm side needs a folder with the setup.sh / bench.sh / stop.sh scripts of a single-host
# Slurm 22.05 benchmark (16 slurmd with gres gpu:8, slurmctld with high-throughput settings,
# PROFILE=tuned; bench.sh prints one JSON line whose phases.sbatch holds submit_rate_jobs_s,
# makespan_s and cpu_s.slurmctld). It is given as the first argument or SLURM_BENCH_DIR; without
# it only the portal side runs. The portal side is bench/vs_portal.py (an installation of its own,
# process sandbox, the portal's default timers). Each side takes a few minutes of both cores.
# With several rounds (ROUNDS, default 1) the sides alternate, Slurm first, and the table gives
# each round's figures and the median ratio: a shared machine's speed drifts by tens of percent
# within minutes, so only figures of one round compare.
set -euo pipefail
cd "$(dirname "$0")/.."
SLURM_DIR=${1:-${SLURM_BENCH_DIR:-}}
JOBS=${2:-1000}
ROUNDS=${3:-${ROUNDS:-1}}
OUT=$(mktemp -d /tmp/vs-slurm.XXXXXX)

for round in $(seq 1 "$ROUNDS"); do
  if [ -n "$SLURM_DIR" ]; then
    echo "== round $round: Slurm: $JOBS x sbatch --gres=gpu:1 --wrap true (tuned profile)" >&2
    (cd "$SLURM_DIR" && PROFILE=tuned ./setup.sh >&2)
    (cd "$SLURM_DIR" && N_HELD=0 N_MIX=0 N_ARRAY=0 PROBES=0 SRUN_PROBES=0 N_SBATCH="$JOBS" ./bench.sh) \
      | tail -n 1 > "$OUT/slurm.$round.json" || true
    (cd "$SLURM_DIR" && ./stop.sh >&2) || true
  fi
  echo "== round $round: gpuportal: $JOBS x POST /api/v1/jobs/" >&2
  .venv/bin/python bench/vs_portal.py --jobs "$JOBS" | tail -n 1 > "$OUT/portal.$round.json"
done

.venv/bin/python - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rounds = sorted(int(f.name.split(".")[1]) for f in out.glob("portal.*.json"))


def sides(r):
    portal = json.loads((out / f"portal.{r}.json").read_text())
    f = out / f"slurm.{r}.json"
    slurm = json.loads(f.read_text())["phases"]["sbatch"] if f.exists() and f.read_text().strip() else None
    return portal, slurm


def rows(portal, slurm):
    jobs = portal["jobs"]
    return [("makespan (s)", portal["makespan_s"], slurm and slurm["makespan_s"]),
            ("serial submit rate (jobs/s)", portal["submit_rate_jobs_s"], slurm and slurm["submit_rate_jobs_s"]),
            ("control-plane CPU per job (ms)", portal["cpu_ms_per_job"]["control"],
             slurm and round(slurm["cpu_s"]["slurmctld"] * 1000 / jobs, 1)),
            ("node-side CPU per job (ms)", portal["cpu_ms_per_job"]["agents"],
             slurm and round(slurm["cpu_s"]["slurmd_all"] * 1000 / jobs, 1)),
            # Each job's supervisor and the job; Slurm's bench counts no slurmstepd.
            ("job supervisor + job CPU per job (ms)", portal["cpu_ms_per_job"].get("jobs"), None),
            # About makespan / SCHEDULER_PASS_INTERVAL_S when passes coalesce (docs/design.md section 10).
            ("scheduling passes that changed something", portal.get("passes"), None)]


ratios: dict[str, list[float]] = {}
for r in rounds:
    portal, slurm = sides(r)
    print(f"round {r}: {portal['jobs']} one-GPU `true` jobs, 16 nodes x 8 GPUs; gpuportal {portal['succeeded']} "
          f"succeeded" + (f", Slurm {slurm['completed']} completed" if slurm else " (Slurm side not run)"))
    print("| | gpuportal | Slurm | gpuportal / Slurm |\n|---|---|---|---|")
    for name, ours, theirs in rows(portal, slurm):
        ratio = ours / theirs if theirs and ours is not None else None
        if ratio is not None:
            ratios.setdefault(name, []).append(ratio)
        print(f"| {name} | {ours} | {theirs if theirs is not None else '-'} | "
              f"{f'{ratio:.2f}' if ratio is not None else '-'} |")
if len(rounds) > 1 and ratios:
    print(f"median ratio over {len(rounds)} rounds (gpuportal / Slurm):")
    for name, values in ratios.items():
        print(f"  {name}: {statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})")
print(f"(raw JSON in {out})")
EOF
