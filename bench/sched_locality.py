"""Dataset locality in the trace simulator: JCT and bytes moved with the scheduler's locality on and off.

    .venv/bin/python bench/sched_locality.py                     # the Philly slice kept in the repository
    .venv/bin/python bench/sched_locality.py --trace $TRACES/philly_dev.csv --quota $TRACES/philly_vc_quota.csv \\
        --start-day 24 --days 7 --gpus 512                       # a busy week of the full trace

Every GPU job of the trace reads one dataset drawn from a catalogue of `--datasets` with Zipf
popularity (`--zipf`), sizes log-uniform in `--dataset-gb` (seeded: `--seeds` replays each row
with several assignments and averages them). A job starting on a node that lacks its dataset
stages it over the node's link (`--node-bandwidth`) into the node's LRU cache (`--node-cache`)
before it runs, holding its GPUs (scheduler/sim/datasets.py). Rows: locality off (the scheduler
sees neither datasets nor caches: placement exactly as without datasets, only the transfers are
modelled), the locality bonus alone (wait 0), the bonus with a capped wait (`--waits`), and the
bonus and a wait with prefetch to reserved nodes due within `--prefetch-horizon`. Columns: mean and median JCT, mean wait, mean
staging per start, the share of starts that found their data on their nodes, TB moved over the
nodes' links (prefetch included), TB of it prefetched and of that what a job starting on the node
then read. Multifactor with EASY backfill and
quotas, as in production.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim.datasets import DataSpec  # noqa: E402
from scheduler.sim.runner import ReplaySpec, replay  # noqa: E402

DATA = ROOT / "tests" / "scheduler" / "data"
KEYS = ("jct_mean", "jct_p50", "wait_mean", "data_staging_mean_s", "data_local_starts", "data_starts",
        "data_bytes_moved", "data_bytes_prefetched", "data_bytes_prefetch_used")


def rows(waits: list[float]) -> list[tuple[str, dict]]:
    out = [("off (scheduler ignores data)", dict(locality=False, prefetch=False, wait=0.0)),
           ("bonus only (wait 0)", dict(locality=True, prefetch=False, wait=0.0))]
    out += [(f"bonus + wait {w:g} s", dict(locality=True, prefetch=False, wait=w)) for w in waits if w > 0]
    out += [(f"bonus + wait {w:g} s + prefetch", dict(locality=True, prefetch=True, wait=w)) for w in waits[:1]]
    return out


def _one(spec: ReplaySpec) -> dict:
    return replay(spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DATA / "philly_dev.csv"))
    ap.add_argument("--quota", default=str(DATA / "philly_vc_quota.csv"))
    ap.add_argument("--start-day", type=float)
    ap.add_argument("--days", type=float)
    ap.add_argument("--gpus", type=int, nargs="+", default=[48, 96], help="cluster sizes, a table each")
    ap.add_argument("--datasets", type=int, default=50, help="datasets in the catalogue")
    ap.add_argument("--zipf", type=float, default=DataSpec.zipf_s)
    ap.add_argument("--dataset-gb", type=float, nargs=2, default=[DataSpec.min_gb, DataSpec.max_gb],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--node-bandwidth", type=float, default=DataSpec.bandwidth_gbps, metavar="GBIT")
    ap.add_argument("--node-cache", type=float, default=DataSpec.cache_gb, metavar="GB")
    ap.add_argument("--waits", type=float, nargs="+", default=[60.0, 600.0], metavar="S",
                    help="capped waits to try (the first also with prefetch)")
    ap.add_argument("--prefetch-horizon", type=float, default=600.0, metavar="S",
                    help="the prefetch row: reservations due within S s prefetch (production's default is 0: off)")
    ap.add_argument("--seeds", type=int, default=3, help="dataset assignments averaged per row")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    base = DataSpec(count=a.datasets, zipf_s=a.zipf, min_gb=a.dataset_gb[0], max_gb=a.dataset_gb[1],
                    bandwidth_gbps=a.node_bandwidth, cache_gb=a.node_cache)
    table = rows(a.waits)
    specs = [ReplaySpec(trace=a.trace, quota=a.quota, start_day=a.start_day, days=a.days, gpus=gpus,
                        fairness=False, explain=False, locality_wait_s=kw["wait"],
                        prefetch_horizon_s=a.prefetch_horizon if kw["prefetch"] else 0.0,
                        data=replace(base, seed=seed, locality=kw["locality"], prefetch=kw["prefetch"]))
             for gpus in a.gpus for _, kw in table for seed in range(a.seeds)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.workers) as ex:
        results = list(ex.map(_one, specs))
    print(f"{Path(a.trace).name}, days {a.start_day if a.start_day is not None else 'all'}"
          f"{f' +{a.days:g}' if a.days else ''}, {results[0]['jobs']} jobs, multifactor + backfill; "
          f"{a.datasets} datasets (Zipf {a.zipf:g}, {a.dataset_gb[0]:g}-{a.dataset_gb[1]:g} GB), "
          f"{a.node_bandwidth:g} Gbit/s and a {a.node_cache:g} GB cache per node; mean of {a.seeds} seed(s)")
    per = len(table) * a.seeds
    for k, gpus in enumerate(a.gpus):
        print()
        print_table(gpus, table, results[k * per:(k + 1) * per], a.seeds)
    print(f"wall {time.perf_counter() - t0:.1f} s")


def print_table(gpus: int, table: list, results: list[dict], seeds: int) -> None:
    util = sum(r["utilization"] for r in results[:seeds]) / seeds
    print(f"{gpus} GPUs ({util:.0%} allocated with locality off)")
    head = (f"{'locality':<34}{'jct_mean_h':>11}{'jct_p50_h':>10}{'wait_h':>8}{'staging_s':>10}"
            f"{'local_%':>8}{'moved_TB':>9}{'prefetched_TB':>14}{'of it used':>11}")
    print(head)
    print("-" * len(head))
    means = {}
    for i, (name, _) in enumerate(table):
        rs = results[i * seeds:(i + 1) * seeds]
        m = {k: sum(r[k] for r in rs) / len(rs) for k in KEYS}
        means[name] = m
        print(f"{name:<34}{m['jct_mean'] / 3600:>11.3f}{m['jct_p50'] / 3600:>10.3f}{m['wait_mean'] / 3600:>8.3f}"
              f"{m['data_staging_mean_s']:>10.0f}{m['data_local_starts'] / max(m['data_starts'], 1):>8.1%}"
              f"{m['data_bytes_moved'] / 1e12:>9.2f}{m['data_bytes_prefetched'] / 1e12:>14.2f}"
              f"{m['data_bytes_prefetch_used'] / 1e12:>11.2f}")
    off = means[table[0][0]]
    for name, m in list(means.items())[1:]:
        print(f"  {name}: mean JCT x{m['jct_mean'] / off['jct_mean']:.3f}, bytes moved "
              f"x{m['data_bytes_moved'] / off['data_bytes_moved']:.3f} of locality off")


if __name__ == "__main__":
    main()
