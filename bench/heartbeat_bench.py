"""Heartbeats per second the portal absorbs: N simulated agents with 8 GPUs each.

Starts gunicorn on a throwaway PostgreSQL database (`gpuportal_bench_hb`), registers N nodes,
then for DURATION seconds client threads post heartbeats (8 GPU samples, one running job each
10th node) as fast as the portal answers. Prints the sustained rate, latency percentiles and
what the target needs (N / 5 s).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/14 \
        .venv/bin/python bench/heartbeat_bench.py --agents 1000 --duration 20
Target (issue #4): 1,000 agents x 8 GPUs every 5 s = 200 heartbeats/s on this 2-core machine.
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ.setdefault("DEBUG", "1")

import django  # noqa: E402

django.setup()

import requests  # noqa: E402
from benchdb import throwaway_database  # noqa: E402
from django.db import connection  # noqa: E402

DB_NAME = "gpuportal_bench_hb"


def setup_nodes(n: int) -> list[tuple[str, str]]:
    from portal.core.context import Actor
    from portal.nodes.services import node_add

    actor = Actor(user=None, label="manage.py")
    out = []
    for i in range(n):
        node, token = node_add(actor=actor, name=f"hb-{i:04d}", gpus="8xH100-80GB")
        out.append((node.name, token))
    return out


def sample(uuid_: str, i: int) -> dict:
    return {"gpu_uuid": uuid_, "ts": time.time(), "utilization": random.randint(0, 100), "memory_used_mb": 1000 + i,
            "memory_total_mb": 81920, "temperature_c": 60, "power_w": 300.0, "power_limit_w": 700.0,
            "ecc_errors": 0, "xid_errors": [], "processes": []}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--port", type=int, default=8799)
    args = ap.parse_args()

    server = None
    with throwaway_database(DB_NAME):
        try:
            t0 = time.perf_counter()
            nodes = setup_nodes(args.agents)
            from portal.nodes.models import GPU

            uuids: dict[str, list[str]] = {}
            for name, uuid_ in GPU.objects.values_list("node__name", "uuid"):
                uuids.setdefault(name, []).append(uuid_)
            print(f"{args.agents} nodes x 8 GPUs registered in {time.perf_counter() - t0:.1f}s")
            db = connection.settings_dict
            env = {**os.environ, "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{DB_NAME}",
                   "DEBUG": "1", "LOG_LEVEL": "WARNING"}
            server = subprocess.Popen([sys.executable, "-m", "gunicorn", "portal.wsgi", "-b", f"127.0.0.1:{args.port}",
                                       "-w", str(args.workers), "--log-level", "warning"], cwd=ROOT, env=env)
            url = f"http://127.0.0.1:{args.port}/api/agent/v1/heartbeat"
            deadline = time.monotonic() + 30
            while True:
                try:
                    requests.get(f"http://127.0.0.1:{args.port}/login/", timeout=10)
                    break
                except (requests.ConnectionError, requests.Timeout):
                    if time.monotonic() > deadline:
                        raise SystemExit("gunicorn did not start")
                    time.sleep(0.2)

            latencies: list[float] = []
            errors = [0]
            lock = threading.Lock()
            stop_at = time.monotonic() + args.duration

            def worker(k: int):
                session = requests.Session()
                mine = nodes[k::args.threads]
                i = 0
                while time.monotonic() < stop_at:
                    name, token = mine[i % len(mine)]
                    i += 1
                    body = {"samples": [sample(u, i) for u in uuids[name]], "jobs": []}
                    t = time.perf_counter()
                    r = session.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
                    dt = time.perf_counter() - t
                    with lock:
                        if r.status_code == 200:
                            latencies.append(dt)
                        else:
                            errors[0] += 1

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
            start = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
            rate = len(latencies) / elapsed
            q = statistics.quantiles(latencies, n=100)
            print(f"heartbeats: {len(latencies)} in {elapsed:.1f}s = {rate:.0f}/s ({rate * 8:.0f} GPU samples/s), "
                  f"errors {errors[0]}; latency p50 {q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms "
                  f"(gunicorn {args.workers} workers, {args.threads} client threads)")
            need = args.agents / 5
            print(f"target: {args.agents} agents every 5 s = {need:.0f}/s -> {'MET' if rate >= need else 'NOT MET'}")
        finally:
            if server is not None:
                server.terminate()
                server.wait(10)


if __name__ == "__main__":
    main()
