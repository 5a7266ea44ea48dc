"""Replay a GPU cluster trace through the scheduler core with a virtual clock.

    python -m scheduler.sim --trace tests/scheduler/data/philly_dev.csv --start-day 48 --days 1 \
        --gpus 384 --gpus-per-node 8 --policy multifactor --quota tests/scheduler/data/philly_vc_quota.csv

Preempted jobs restart from zero, or resume from their last checkpoint (the time since it and the
grace are lost) when they checkpoint: as their trace row's checkpoint_grace_s and
checkpoint_interval_s say, or, with --checkpoint-interval, every job whose row names none. With --datasets N jobs read
datasets of a Zipf popularity, staged to nodes over their links and cached (locality on unless
--no-locality; docs/scheduler.md, "Dataset locality"). Prints the docs/design.md section 9 metrics,
overall and per tenant, as a table or (--json) as one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from scheduler.core.ordering import POLICIES

from .datasets import DataSpec
from .runner import ReplaySpec, replay


def _f(v, unit="") -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if unit == "h":
        return f"{v / 3600:.2f}"
    if unit == "%":
        return f"{v * 100:.1f}"
    return f"{v:.2f}"


def print_table(out: dict, file=sys.stdout) -> None:
    cols = [("jobs", ""), ("jct_mean", "h"), ("jct_p50", "h"), ("jct_p95", "h"), ("jct_p99", "h"),
            ("wait_mean", "h"), ("bounded_slowdown_mean", ""), ("utilization", "%"),
            ("fragmentation", "%"), ("fairness_max", ""), ("preemptions", ""), ("lost_gpu_hours", "")]
    heads = ["tenant", "jobs", "jct_mean_h", "jct_p50_h", "jct_p95_h", "jct_p99_h", "wait_h", "bsld",
             "util_%", "frag_%", "fairness", "preempt", "lost_gpu_h"]
    rows = [["ALL"] + [_f(out[k], u) for k, u in cols]]
    for t, m in out["tenants"].items():
        rows.append([t] + [_f(m[k], u) for k, u in cols])
    widths = [max(len(r[i]) for r in rows + [heads]) for i in range(len(heads))]
    for r in [heads] + rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)
    print(f"{out['gpus']:.0f} GPUs, policy {out['policy']}{' + backfill' if out['backfill'] and out['policy'] in ('multifactor', 'las') else ''}, "
          f"{out['passes']} passes ({out['passes_skipped']} skipped: nothing could change), {out['dropped']} jobs dropped (larger than the cluster), "
          f"{out['multi_node']} replayed on several nodes, {out['unsplittable']} skipped (GPUs not divisible "
          f"over nodes), {out['fragmented_jobs']} waited fragmented (mean {out['fragmented_wait_mean'] / 3600:.2f} h, "
          f"frag_% while one did {out['fragmentation_split'] * 100:.1f}), "
          f"wall {out['wall_s']:.1f} s (shared replay {out['wall_s_shared']:.1f} s). "
          f"Tenant utilization is over its guarantee; fairness = mean JCT shared / isolated (on its "
          f"guarantee, or an equal share without one); wait counts every attempt's wait.", file=file)
    if "data_bytes_moved" in out:
        print(f"Datasets: {out['data_bytes_moved'] / 1e12:.2f} TB moved ({out['data_bytes_prefetched'] / 1e12:.2f} TB "
              f"prefetched), {out['data_local_starts']} of {out['data_starts']} starts found their data on their "
              f"nodes, staging {out['data_staging_mean_s']:.0f} s per start on average.", file=file)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m scheduler.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="trace CSV (docs/design.md section 9 format)")
    ap.add_argument("--start-day", type=float, default=None, help="first day of the window (from trace time 0)")
    ap.add_argument("--days", type=float, default=None, help="length of the window in days")
    ap.add_argument("--gpus", type=int, default=384, help="cluster size in GPUs (ignored with --nodes)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", help="node list CSV (sn,cpu_milli,memory_mib,gpu,model); GPUs are shared")
    ap.add_argument("--policy", default="multifactor", choices=list(POLICIES),
                    help="fifo: strict head of line; fifo-backfill: first fit in submit order")
    ap.add_argument("--placement", default="bestfit", choices=["bestfit", "spread"])
    ap.add_argument("--no-backfill", action="store_true")
    ap.add_argument("--no-preemption", action="store_true")
    ap.add_argument("--no-quotas", action="store_true",
                    help="guarantees take no part: nothing borrowed, no guarantee-first order or preemption")
    ap.add_argument("--quota", help="tenant quota CSV (vc,node num): guarantees scaled to the cluster")
    ap.add_argument("--load-scale", type=float, default=1.0, help="divide inter-arrival gaps by this")
    ap.add_argument("--no-explain", action="store_true",
                    help="skip the reasons production writes (same decisions, about a third faster)")
    ap.add_argument("--no-fairness", action="store_true", help="skip the isolated per-tenant replays")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="processes for the isolated replays")
    ap.add_argument("--checkpoint-interval", type=float, default=None, metavar="S",
                    help="every job whose trace row names no checkpoint saves every S seconds of its run "
                         "(0: only when signalled) and "
                         "resumes from its last checkpoint when preempted")
    ap.add_argument("--checkpoint-grace", type=float, default=120.0, metavar="S",
                    help="seconds a preempted job gets to save (counted as lost GPU-time); with --checkpoint-interval")
    ap.add_argument("--datasets", type=int, default=0, metavar="N",
                    help="jobs read one of N datasets of Zipf popularity (seeded); 0: none")
    ap.add_argument("--zipf", type=float, default=DataSpec.zipf_s, help="Zipf exponent of dataset popularity")
    ap.add_argument("--dataset-seed", type=int, default=0)
    ap.add_argument("--dataset-gb", type=float, nargs=2, default=[DataSpec.min_gb, DataSpec.max_gb],
                    metavar=("MIN", "MAX"), help="dataset sizes, log-uniform between these")
    ap.add_argument("--node-bandwidth", type=float, default=DataSpec.bandwidth_gbps, metavar="GBIT",
                    help="each node's link for staging datasets, Gbit/s")
    ap.add_argument("--node-cache", type=float, default=DataSpec.cache_gb, metavar="GB",
                    help="each node's dataset cache (LRU; datasets in use are pinned)")
    ap.add_argument("--no-locality", action="store_true",
                    help="the scheduler ignores datasets and caches (transfers are still modelled)")
    ap.add_argument("--locality-wait", type=float, default=ReplaySpec.locality_wait_s, metavar="S",
                    help="a job waits up to S s after it entered the queue for a busy node holding its data")
    ap.add_argument("--no-prefetch", action="store_true", help="reserved nodes do not fetch ahead")
    ap.add_argument("--prefetch-horizon", type=float, default=ReplaySpec.prefetch_horizon_s, metavar="S",
                    help="a reservation due within S s asks its nodes to prefetch (0, the default: never)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    spec = ReplaySpec(trace=a.trace, start_day=a.start_day, days=a.days, gpus=a.gpus,
                      gpus_per_node=a.gpus_per_node, policy=a.policy, backfill=not a.no_backfill,
                      preemption=not a.no_preemption, quotas=not a.no_quotas, explain=not a.no_explain, placement=a.placement, quota=a.quota, nodes=a.nodes,
                      load_scale=a.load_scale, fairness=not a.no_fairness, workers=a.workers,
                      checkpoint_interval_s=a.checkpoint_interval, checkpoint_grace_s=a.checkpoint_grace,
                      data=DataSpec(count=a.datasets, zipf_s=a.zipf, seed=a.dataset_seed, min_gb=a.dataset_gb[0],
                                    max_gb=a.dataset_gb[1], bandwidth_gbps=a.node_bandwidth, cache_gb=a.node_cache,
                                    locality=not a.no_locality, prefetch=not a.no_prefetch) if a.datasets else None,
                      locality_wait_s=a.locality_wait, prefetch_horizon_s=a.prefetch_horizon)
    out = replay(spec)
    if a.json:
        print(json.dumps(out, indent=None, sort_keys=True))
    else:
        print_table(out)


if __name__ == "__main__":
    main()
