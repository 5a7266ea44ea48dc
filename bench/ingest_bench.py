"""GPU sample ingest into PostgreSQL: samples per second (target 20,000/s on a 2-core machine).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench .venv/bin/python bench/ingest_bench.py [--samples 200000]

Runs in a throwaway database (test_<name>, created with migrations and dropped at the end).
Reports three paths:
  heartbeat  samples_ingest() per heartbeat of one 8-GPU node: GPU lookup, health rules, the
             process buffer and its COPY every METRICS_INGEST_BATCH rows (what agent_heartbeat
             does; the HTTP request itself is not included)
  copy-8     samples_write() with 8-row batches (the COPY alone, one heartbeat's worth)
  copy-2000  samples_write() with 2,000-row batches (a buffered writer's batch)
"""
import argparse
import os
import statistics
import time
from datetime import datetime, timedelta, timezone as dt_timezone

from benchdb import DEVELOPMENT, django_setup, throwaway_database


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200_000, help="samples per path")
    parser.add_argument("--nodes", type=int, default=125)
    args = parser.parse_args()

    django_setup(DEVELOPMENT)
    with throwaway_database("gpuportal_bench_ingest"):
        run(args)


def run(args) -> None:
    from portal.metrics.models import GpuSample
    from portal.metrics.services import samples_flush, samples_ingest, samples_write
    from portal.nodes.models import GPU, Node

    nodes = Node.objects.bulk_create([Node(name=f"n{i:04d}") for i in range(args.nodes)])
    GPU.objects.bulk_create([GPU(node=n, index=j, uuid=f"GPU-{n.name}-{j}", model="H100-80GB", memory_mb=81920)
                             for n in nodes for j in range(8)])
    gpus = list(GPU.objects.values_list("pk", "uuid", "node_id"))
    start = datetime.now(dt_timezone.utc)

    def rows(n):
        for i in range(n):
            pk = gpus[i % len(gpus)][0]
            yield (pk, start + timedelta(milliseconds=i), 50.0, 4096, 81920, 60.0, 300.0, 0, [])

    results = {}
    for name, batch in (("copy-8", 8), ("copy-2000", 2000)):
        data = list(rows(args.samples))
        t0 = time.perf_counter()
        for i in range(0, len(data), batch):
            samples_write(data[i:i + batch])
        results[name] = len(data) / (time.perf_counter() - t0)

    by_node = {n.pk: n for n in nodes}
    per_node = {}
    for pk, uuid, node_id in gpus:
        per_node.setdefault(node_id, []).append(uuid)
    beats = args.samples // 8
    now_ts = start.timestamp()
    node_ids = list(per_node)
    latencies = []
    t0 = time.perf_counter()
    for i in range(beats):
        node_id = node_ids[i % len(node_ids)]
        samples = [{"gpu_uuid": u, "ts": now_ts, "utilization": 50, "memory_used_mb": 4096, "memory_total_mb": 81920,
                    "temperature_c": 60, "power_w": 300, "ecc_errors": 0, "xid_errors": []} for u in per_node[node_id]]
        t1 = time.perf_counter()
        samples_ingest(node=by_node[node_id], samples=samples)
        latencies.append(time.perf_counter() - t1)
    samples_flush()
    results["heartbeat"] = beats * 8 / (time.perf_counter() - t0)

    total = GpuSample.objects.count()
    print(f"GPU sample ingest into PostgreSQL ({os.cpu_count()} CPUs, {len(gpus)} GPUs, {total} rows written)")
    for name in ("heartbeat", "copy-8", "copy-2000"):
        mark = "meets" if results[name] >= 20_000 else "below"
        print(f"  {name:<10} {results[name]:>10,.0f} samples/s  ({mark} the 20,000/s target)")
    latencies.sort()
    print(f"  heartbeat ingest latency: p50 {statistics.median(latencies) * 1000:.2f} ms, "
          f"p99 {latencies[int(len(latencies) * 0.99)] * 1000:.2f} ms per 8-GPU heartbeat")


if __name__ == "__main__":
    main()
