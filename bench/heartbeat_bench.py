"""Heartbeats per second the portal absorbs: N simulated agents with 8 GPUs each.

Starts gunicorn on a throwaway PostgreSQL database (`gpuportal_bench_hb`), registers N nodes,
then for DURATION seconds client threads post heartbeats (8 GPU samples, one running job each
10th node) as fast as the portal answers. Prints the sustained rate, latency percentiles and
what the target needs (N / 5 s).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/14 \
        .venv/bin/python bench/heartbeat_bench.py --agents 1000 --duration 20
Target (issue #4): 1,000 agents x 8 GPUs every 5 s = 200 heartbeats/s on this 2-core machine.

With --paced, each agent heartbeats at the default interval (NODE_HEARTBEAT_INTERVAL_S, as a
real agent does) instead of as fast as possible, and the reaper runs every NODE_REAP_INTERVAL_S
beside them: it prints how many nodes were falsely marked down (the goal is 0), the longest
silence the portal saw from one node against NODE_TIMEOUT_S, and the longest time an agent went
without an answered heartbeat against its lease (AGENT_LEASE_S).

    ... bench/heartbeat_bench.py --agents 1000 --duration 60 --paced
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
    ap.add_argument("--paced", action="store_true", help="each agent every NODE_HEARTBEAT_INTERVAL_S, reaper running")
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

            if args.paced:
                return paced(args, nodes, uuids, url)
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


def paced(args, nodes, uuids, url) -> None:
    """1,000 agents at the real interval with the reaper beside them: false downs, silences, leases.

    Each agent is its own coroutine (one connection per heartbeat, as the agent's client after
    an idle interval), so a slow answer delays only that agent, as in a real fleet."""
    import asyncio
    import json

    from django.conf import settings

    interval = settings.NODE_HEARTBEAT_INTERVAL_S
    latencies: list[float] = []
    errors = [0]
    worst_lease_gap = [0.0]
    stop = threading.Event()
    reaper_out = {"downs": 0, "worst_silence": 0.0, "runs": 0}
    path = url.split(str(args.port), 1)[1]

    def reaper():
        from django.db import connection as conn
        from django.utils import timezone

        from portal.nodes.models import Node
        from portal.nodes.services import nodes_reap

        stop.wait(settings.NODE_TIMEOUT_S)  # every node has had its first beats before the reaper judges
        while not stop.is_set():
            oldest = Node.objects.order_by("last_heartbeat_at").values_list("last_heartbeat_at", flat=True).first()
            reaper_out["worst_silence"] = max(reaper_out["worst_silence"], (timezone.now() - oldest).total_seconds())
            reaper_out["downs"] += nodes_reap().get("down", 0)
            reaper_out["runs"] += 1
            stop.wait(settings.NODE_REAP_INTERVAL_S)
        conn.close()

    async def post(token: str, body: bytes) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        try:
            writer.write((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                          f"Connection: close\r\n\r\n").encode() + body)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            await reader.read()
            return status
        finally:
            writer.close()

    async def agent(name: str, token: str, stop_at: float):
        await asyncio.sleep(random.uniform(0, interval))  # agents started at different times
        last_ok = time.monotonic()
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            body = json.dumps({"samples": [sample(u, i) for u in uuids[name]], "jobs": []}).encode()
            sent = time.monotonic()
            try:
                ok = await asyncio.wait_for(post(token, body), 30) == 200
            except (OSError, asyncio.TimeoutError, ValueError, IndexError):
                ok = False
            done = time.monotonic()
            # The agent's lease runs from the sending of its last answered heartbeat, renewed only
            # when the next answer arrives: its age peaks just before that (or at a failure).
            worst_lease_gap[0] = max(worst_lease_gap[0], done - last_ok)
            if ok:
                latencies.append(done - sent)
                last_ok = sent
            else:
                errors[0] += 1
            await asyncio.sleep(interval)  # an agent waits the interval after each heartbeat
        worst_lease_gap[0] = max(worst_lease_gap[0], time.monotonic() - last_ok)

    async def fleet():
        stop_at = time.monotonic() + args.duration
        await asyncio.gather(*(agent(name, token, stop_at) for name, token in nodes))

    th = threading.Thread(target=reaper)
    th.start()
    start = time.monotonic()
    try:
        asyncio.run(fleet())
    finally:
        stop.set()
        th.join()
    elapsed = time.monotonic() - start
    q = statistics.quantiles(latencies, n=100)
    print(f"paced: {args.agents} agents every {interval:g}s for {elapsed:.0f}s: {len(latencies)} heartbeats "
          f"({len(latencies) / elapsed:.0f}/s), errors {errors[0]}; latency p50 {q[49] * 1000:.0f} ms, "
          f"p99 {q[98] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    print(f"reaper: {reaper_out['runs']} runs every {settings.NODE_REAP_INTERVAL_S:g}s, nodes marked down: "
          f"{reaper_out['downs']} (goal 0); longest silence it saw {reaper_out['worst_silence']:.1f}s "
          f"(NODE_TIMEOUT_S {settings.NODE_TIMEOUT_S:g}s)")
    gap = worst_lease_gap[0]
    print(f"agents: longest lease age (since the last answered heartbeat was sent) {gap:.1f}s "
          f"(AGENT_LEASE_S {settings.AGENT_LEASE_S:g}s) "
          f"-> {'no false fence' if gap < settings.AGENT_LEASE_S else 'an agent would have FENCED'}")

if __name__ == "__main__":
    main()
