"""Autoscaling on a trace: GPU-hours paid and used, JCT and wait, against a fixed cluster.

    .venv/bin/python bench/autoscale_sim.py                       # the Philly slice kept in the repository
    .venv/bin/python bench/autoscale_sim.py --trace $TRACES/philly_dev.csv --start-day 24 --days 7 --max-nodes 64

The production scheduler core places the jobs and the production autoscaler
(scheduler/core/autoscale.py) adds and releases 8-GPU nodes, through scheduler/sim/autoscale.py:
a node takes jobs `--boot` seconds after it is asked for and is paid from then; the autoscaler
ticks every `--tick` seconds. The first row keeps `--max-nodes` nodes on for the whole replay;
the others scale from zero, releasing a node after each idle time. No preemption, so the rows
differ only by capacity.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.core.autoscale import PoolSpec  # noqa: E402
from scheduler.sim.autoscale import compare  # noqa: E402
from scheduler.sim.trace import read_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT / "tests/scheduler/data/philly_dev.csv"))
    ap.add_argument("--start-day", type=float)
    ap.add_argument("--days", type=float)
    ap.add_argument("--max-nodes", type=int, default=6)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--max-per-step", type=int, default=4)
    ap.add_argument("--boot", type=float, default=180.0, help="seconds from asking for a node to its first job")
    ap.add_argument("--tick", type=float, default=30.0)
    ap.add_argument("--idle", default="60,600,3600", help="idle times to compare, seconds")
    ap.add_argument("--price", type=float, default=2.5, help="per GPU-hour")
    args = ap.parse_args()
    jobs = read_trace(args.trace, args.start_day, args.days)
    pool = PoolSpec(name="pool", gpu_model="GPU", gpus_per_node=args.gpus_per_node, price_per_gpu_hour=args.price,
                    max_nodes=args.max_nodes, max_per_step=args.max_per_step, boot_estimate_s=args.boot)
    t0 = time.perf_counter()
    rows = compare(jobs, pool, boot_s=args.boot, tick_s=args.tick, idle_times=[float(x) for x in args.idle.split(",")])
    print(f"{len(jobs)} jobs, up to {args.max_nodes} nodes of {args.gpus_per_node} GPUs, boot {args.boot:g} s, "
          f"tick {args.tick:g} s ({time.perf_counter() - t0:.1f} s)")
    print(f"{'cluster':<22}{'GPU-h paid':>12}{'GPU-h used':>12}{'used/paid':>10}{'cost':>12}{'JCT mean h':>11}"
          f"{'JCT p95 h':>10}{'wait mean h':>12}{'peak nodes':>11}{'nodes made':>11}")
    for r in rows:
        name = "fixed" if r["mode"] == "fixed" else f"autoscale idle {r['idle_release_s']:g} s"
        print(f"{name:<22}{r['gpu_hours_paid']:>12,.0f}{r['gpu_hours_used']:>12,.0f}{r['used_of_paid']:>10.1%}"
              f"{r['cost']:>12,.0f}{r['jct_mean_h']:>11.2f}{r['jct_p95_h']:>10.2f}{r['wait_mean_h']:>12.2f}"
              f"{r['nodes_peak']:>11}{r['nodes_created']:>11}")


if __name__ == "__main__":
    main()
