"""Heartbeats per second the portal absorbs: N simulated agents with 8 GPUs each.

Starts gunicorn on a throwaway PostgreSQL database (`gpuportal_bench_hb`), registers N nodes,
then for DURATION seconds clients post heartbeats as fast as the portal answers, each with
--per-gpu per-second samples of each of the 8 GPUs (5: 40 samples, what an agent sampling each
second sends every 5 s). The clients are asyncio coroutines on raw sockets, cheap beside the
portal. Prints the sustained heartbeats/s and samples/s, latency percentiles, and the CPU the
portal spent per heartbeat: gunicorn's workers, the PostgreSQL backends of the bench database
and Redis (REDIS_URL's server, from its INFO). On a shared machine the rate moves with the
neighbours' load; the CPU per heartbeat much less, and 2 / (CPU per heartbeat) is the rate
two otherwise idle cores could carry.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/14 \
        .venv/bin/python bench/heartbeat_bench.py --agents 1000 --duration 20
Target (issue 14): 1,000 agents x 40 samples every 5 s = 200 heartbeats/s (8,000 samples/s)
on this 2-core machine.

With --paced, each agent heartbeats at the default interval (NODE_HEARTBEAT_INTERVAL_S, as a
real agent does) instead of as fast as possible, and the reaper (nodes_reap, what the worker runs)
runs every NODE_REAP_INTERVAL_S beside them: it prints the heartbeats/s achieved, how late the
heartbeats came (an agent's time between two answered heartbeats beyond the interval), how many
live nodes were falsely marked down (the goal is 0), the longest silence the portal saw from a live
node against NODE_TIMEOUT_S, the longest time an agent went without an answered heartbeat against
its lease (AGENT_LEASE_S), and the detection time of dead nodes: --kill agents stop heartbeating
a third of the way in, and each one's time from its death to `down` is measured (the goal: 30 s).

    ... bench/heartbeat_bench.py --agents 1000 --duration 90 --paced --kill 10
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

from benchdb import DEVELOPMENT, ROOT, django_setup, throwaway_database

django_setup(DEVELOPMENT)

import requests  # noqa: E402
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


def sample(uuid_: str, i: int, ago: float = 0.0) -> dict:
    return {"gpu_uuid": uuid_, "ts": time.time() - ago, "utilization": random.randint(0, 100),
            "memory_used_mb": 1000 + i, "memory_total_mb": 81920, "temperature_c": 60, "power_w": 300.0,
            "power_limit_w": 700.0, "ecc_errors": 0, "xid_errors": [], "processes": []}


def samples_for(uuids: list[str], i: int, per_gpu: int) -> list[dict]:
    """One heartbeat's samples: per_gpu readings a second apart of each GPU, oldest first."""
    return [sample(u, i, ago=float(per_gpu - 1 - k)) for k in range(per_gpu) for u in uuids]


def _ticks(pid: int) -> int:
    """CPU clock ticks (user + system) a process has used; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


class CpuMeter:
    """CPU seconds of the portal's side: gunicorn (master and workers), the PostgreSQL backends
    serving the bench database (on this machine), and the Redis server of REDIS_URL."""

    def __init__(self, gunicorn_pid: int):
        self.gunicorn_pid = gunicorn_pid

    def pids(self) -> dict[str, list[int]]:
        try:
            children = Path(f"/proc/{self.gunicorn_pid}/task/{self.gunicorn_pid}/children").read_text().split()
        except OSError:
            children = []
        with connection.cursor() as c:
            c.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", [DB_NAME])
            backends = [r[0] for r in c.fetchall()]
        return {"web": [self.gunicorn_pid, *map(int, children)], "postgres": backends}

    def redis_cpu(self) -> float:
        from django.conf import settings

        url = settings.CACHES["default"].get("LOCATION")
        if not url or not str(url).startswith("redis"):
            return 0.0
        import redis

        info = redis.Redis.from_url(url).info("cpu")
        return info["used_cpu_user"] + info["used_cpu_sys"]

    def snapshot(self) -> dict[str, float]:
        hz = os.sysconf("SC_CLK_TCK")
        out = {name: sum(_ticks(p) for p in pids) / hz for name, pids in self.pids().items()}
        out["redis"] = self.redis_cpu()
        return out

    @staticmethod
    def report(before: dict, after: dict, count: int) -> str:
        per = {k: (after[k] - before.get(k, 0.0)) / max(count, 1) * 1000 for k in after}
        total = sum(per.values())
        parts = ", ".join(f"{k} {v:.2f}" for k, v in per.items())
        return (f"portal CPU per heartbeat {total:.2f} ms ({parts}) -> two idle cores carry about "
                f"{2000 / total:.0f} heartbeats/s" if total else "portal CPU: not measured")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--per-gpu", type=int, default=5, help="samples per GPU per heartbeat (one a second)")
    ap.add_argument("--clients", type=int, default=16, help="heartbeats in flight at once (unpaced)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--port", type=int, default=0, help="default: a free one")
    ap.add_argument("--paced", action="store_true", help="each agent every NODE_HEARTBEAT_INTERVAL_S, reaper running")
    ap.add_argument("--kill", type=int, default=10, help="paced: agents that die a third of the way in")
    args = ap.parse_args()
    if not args.port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]

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
                   # Production settings: DEBUG off (no query log), plain HTTP on the loopback.
                   "DEBUG": "0", "SECRET_KEY": "bench-" + "abcdefghij" * 6, "ALLOWED_HOSTS": "127.0.0.1,localhost",
                   "SECURE_SSL_REDIRECT": "0", "LOG_LEVEL": "WARNING"}
            server = subprocess.Popen([sys.executable, "-m", "gunicorn", "portal.wsgi", "-b", f"127.0.0.1:{args.port}",
                                       "-w", str(args.workers), "--log-level", "warning"], cwd=ROOT, env=env)
            url = f"http://127.0.0.1:{args.port}/api/agent/v1/heartbeat"
            deadline = time.monotonic() + 120  # a loaded machine starts four workers slowly
            while True:
                try:
                    requests.get(f"http://127.0.0.1:{args.port}/login/", timeout=10)
                    break
                except (requests.ConnectionError, requests.Timeout):
                    if time.monotonic() > deadline:
                        raise SystemExit("gunicorn did not start")
                    time.sleep(0.2)

            meter = CpuMeter(server.pid)
            if args.paced:
                return paced(args, nodes, uuids, url, meter, env)
            flat(args, nodes, uuids, url, meter)
        finally:
            if server is not None:
                server.terminate()
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()


async def post(port: int, path: str, token: str, body: bytes) -> int:
    """One heartbeat on its own connection (as an agent's client after an idle interval)."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
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


def flat(args, nodes, uuids, url, meter) -> None:
    """As many heartbeats as the portal answers, --clients at a time, for --duration seconds."""
    import asyncio
    import json

    path = url.split(str(args.port), 1)[1]
    latencies: list[float] = []
    errors = [0]
    # Bodies made beforehand: the clients' CPU stays out of the portal's way.
    bodies = [(token, json.dumps({"samples": samples_for(uuids[name], i, args.per_gpu), "jobs": []}).encode())
              for i, (name, token) in enumerate(nodes)]

    async def client(k: int, stop_at: float):
        i = k
        while time.monotonic() < stop_at:
            token, body = bodies[i % len(bodies)]
            i += args.clients
            sent = time.perf_counter()
            try:
                ok = await asyncio.wait_for(post(args.port, path, token, body), 30) == 200
            except (OSError, asyncio.TimeoutError, ValueError, IndexError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - sent)
            else:
                errors[0] += 1

    async def run(seconds: float):
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(client(k, stop_at) for k in range(args.clients)))

    asyncio.run(run(2.0))  # warm: every worker has its connections and caches
    latencies.clear()
    before = meter.snapshot()
    start = time.monotonic()
    asyncio.run(run(args.duration))
    elapsed = time.monotonic() - start
    after = meter.snapshot()
    rate = len(latencies) / elapsed
    n = 8 * args.per_gpu
    q = statistics.quantiles(latencies, n=100)
    print(f"heartbeats: {len(latencies)} in {elapsed:.1f}s = {rate:.0f} heartbeats/s, {rate * n:.0f} samples/s "
          f"({n} samples each), errors {errors[0]}; latency p50 {q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms "
          f"(gunicorn {args.workers} workers, {args.clients} clients)")
    print(CpuMeter.report(before, after, len(latencies)))
    need = args.agents / 5
    print(f"target: {args.agents} agents every 5 s = {need:.0f}/s -> measured {'MET' if rate >= need else 'NOT MET'} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


# The reaper in a process of its own, as the Celery worker runs it: nodes_reap every NODE_REAP_INTERVAL_S
# (beat's period, whatever a run takes), from NODE_TIMEOUT_S in, once every agent has had its first beats.
REAPER = """
import sys, time
import django
django.setup()
from django.conf import settings
from portal.jobs.node_effects import nodes_reap
stop_at = time.monotonic() + float(sys.argv[1])
time.sleep(settings.NODE_TIMEOUT_S)
runs, due, lag, held = 0, time.monotonic(), 0.0, 0
while time.monotonic() < stop_at:
    result = nodes_reap()
    lag, held = max(lag, result.get("ingest_lag_s", 0.0)), max(held, result.get("held", 0))
    runs += 1
    due += settings.NODE_REAP_INTERVAL_S
    time.sleep(max(0.0, due - time.monotonic()))
print("REAPER_RUNS", runs, lag, held)
"""


def paced(args, nodes, uuids, url, meter, env) -> None:
    """1,000 agents at the real interval with the reaper beside them: false downs, silences, leases,
    and the time to detect dead nodes.

    Each agent is its own coroutine (one connection per heartbeat, as the agent's client after
    an idle interval), so a slow answer delays only that agent, as in a real fleet. The reaper is
    a process of its own (the worker's role); the nodes it marked down are read from the audit
    trail (`node.down`), so a live node marked down and back by the end still counts."""
    import asyncio
    import json

    from django.conf import settings

    interval = settings.NODE_HEARTBEAT_INTERVAL_S
    latencies: list[float] = []
    lateness: list[float] = []  # per answered heartbeat: time since the agent's previous answer, beyond the interval
    errors = [0]
    worst_lease_gap = [0.0]
    stop = threading.Event()
    reaper_out = {"worst_silence": 0.0}
    path = url.split(str(args.port), 1)[1]
    if args.kill >= args.agents:
        raise SystemExit("--kill must leave live agents")
    doomed = set(random.sample([name for name, _ in nodes], args.kill))
    kill_at = [None]  # monotonic: when the doomed agents stop heartbeating (set by the fleet)
    died: dict[str, float] = {}  # name -> wall-clock time of death (the reaper's audit rows are on this machine's clock)

    def watch_silence():  # the longest silence of a live node, as the reaper would see it
        from django.db import connection as conn
        from django.utils import timezone

        from portal.nodes.models import Node

        stop.wait(settings.NODE_TIMEOUT_S)
        while not stop.is_set():
            oldest = (Node.objects.exclude(name__in=doomed).order_by("last_heartbeat_at")
                      .values_list("last_heartbeat_at", flat=True).first())
            reaper_out["worst_silence"] = max(reaper_out["worst_silence"], (timezone.now() - oldest).total_seconds())
            stop.wait(settings.NODE_REAP_INTERVAL_S)
        conn.close()

    async def agent(name: str, token: str, stop_at: float):
        await asyncio.sleep(random.uniform(0, interval))  # agents started at different times
        last_ok = time.monotonic()
        last_answer = None
        i = 0
        while time.monotonic() < stop_at:
            if name in doomed and time.monotonic() >= kill_at[0]:
                died[name] = time.time()  # dead: no more heartbeats (its last one was answered)
                return
            i += 1
            body = json.dumps({"samples": samples_for(uuids[name], i, args.per_gpu), "jobs": []}).encode()
            sent = time.monotonic()
            try:
                ok = await asyncio.wait_for(post(args.port, path, token, body), 30) == 200
            except (OSError, asyncio.TimeoutError, ValueError, IndexError):
                ok = False
            done = time.monotonic()
            # The agent's lease runs from the sending of its last answered heartbeat, renewed only
            # when the next answer arrives: its age peaks just before that (or at a failure).
            worst_lease_gap[0] = max(worst_lease_gap[0], done - last_ok)
            if ok:
                latencies.append(done - sent)
                if last_answer is not None:
                    lateness.append(done - last_answer - interval)
                last_answer = done
                last_ok = sent
            else:
                errors[0] += 1
            await asyncio.sleep(interval)  # an agent waits the interval after each heartbeat
        worst_lease_gap[0] = max(worst_lease_gap[0], time.monotonic() - last_ok)

    async def fleet():
        stop_at = time.monotonic() + args.duration
        kill_at[0] = time.monotonic() + args.duration / 3
        await asyncio.gather(*(agent(name, token, stop_at) for name, token in nodes))

    th = threading.Thread(target=watch_silence)
    th.start()
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(args.duration)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)
    before = meter.snapshot()
    start = time.monotonic()
    try:
        asyncio.run(fleet())
    finally:
        stop.set()
        th.join()
        runs, lag, held = next((ln.split()[1:4] for ln in reaper.communicate(timeout=120)[0].splitlines()
                                if ln.startswith("REAPER_RUNS")), ("?", "?", "?"))
    elapsed = time.monotonic() - start
    after = meter.snapshot()
    from portal.core.models import AuditEvent
    from portal.nodes.models import Node

    names = dict(Node.objects.values_list("pk", "name"))
    downs = [(names[int(pk)], at.timestamp()) for pk, at in
             AuditEvent.objects.filter(action="node.down").values_list("object_id", "created_at")]
    false_downs = len({n for n, _ in downs if n not in doomed})
    detected: dict[str, float] = {}
    for n, at in downs:
        if n in doomed:
            detected[n] = min(at, detected.get(n, at))
    q = statistics.quantiles(latencies, n=100)
    late = statistics.quantiles(lateness, n=100)
    rate = len(latencies) / elapsed
    print(f"paced: {args.agents} agents every {interval:g}s for {elapsed:.0f}s: {len(latencies)} heartbeats "
          f"({rate:.0f} heartbeats/s, {rate * 8 * args.per_gpu:.0f} samples/s), errors {errors[0]}; latency p50 "
          f"{q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    print(CpuMeter.report(before, after, len(latencies)) + " (the reaper's database queries included)")
    print(f"heartbeat lateness (an agent's time between two answers beyond the {interval:g}s interval): "
          f"p50 {late[49]:.2f}s, p99 {late[98]:.2f}s, max {max(lateness):.2f}s")
    print(f"reaper (its own process): {runs} runs every {settings.NODE_REAP_INTERVAL_S:g}s, nodes marked down: "
          f"{len(downs)} ({len(doomed)} dead); live nodes falsely marked down (node lost): {false_downs} "
          f"(goal 0); longest silence it saw from a live node {reaper_out['worst_silence']:.1f}s "
          f"(NODE_TIMEOUT_S {settings.NODE_TIMEOUT_S:g}s)")
    behind = AuditEvent.objects.filter(action="reaper.portal_behind").count()
    print(f"reaper's ingest lag (how late the portal heard heartbeats): max {lag}s; spells behind {behind}; "
          f"most nodes past NODE_TIMEOUT_S held at once {held}")
    if doomed:
        times = sorted(detected[n] - died[n] for n in doomed if n in detected and n in died)  # wall clock, one machine
        missed = len(doomed) - len(times)
        print(f"dead nodes: {len(doomed)} agents stopped {args.duration / 3:.0f}s in; from death to down: "
              + (f"min {times[0]:.1f}s, p50 {statistics.median(times):.1f}s, max {times[-1]:.1f}s" if times else "none")
              + (f", {missed} NOT detected before the end" if missed else "")
              + f" (goal 30s; NODE_TIMEOUT_S {settings.NODE_TIMEOUT_S:g}s + reaper every "
              f"{settings.NODE_REAP_INTERVAL_S:g}s, counted from the last heartbeat, up to "
              f"{interval:g}s before the death)")
    gap = worst_lease_gap[0]
    print(f"agents: longest lease age (since the last answered heartbeat was sent) {gap:.1f}s "
          f"(AGENT_LEASE_S {settings.AGENT_LEASE_S:g}s) "
          f"-> {'no false fence' if gap < settings.AGENT_LEASE_S else 'an agent would have FENCED'}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
