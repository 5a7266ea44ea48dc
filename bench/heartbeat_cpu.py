"""CPU per heartbeat in one process, through the whole Django stack (middleware, DRF, services).

Registers a few 8-GPU nodes on a throwaway PostgreSQL database (`gpuportal_bench_hbcpu`), then
posts heartbeats with Django's test client (the same WSGI handler gunicorn calls) and prints
the process CPU time per heartbeat: best of --repeat rounds of --count heartbeats each. With
--profile it prints the top functions of one round by cumulative time (cProfile, standard
library). The cache is the one REDIS_URL names (Redis, as in production).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/x REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python bench/heartbeat_cpu.py [--per-gpu 5] [--jobs 0] [--profile]

--per-gpu 5: five per-second samples of each of 8 GPUs (40 a heartbeat, every 5 s), what an
agent that samples each second sends. The CPU a heartbeat costs bounds the rate two cores can
absorb: 200 heartbeats/s on 2 cores leaves 10 ms each, for gunicorn, PostgreSQL and Redis.
"""
import argparse
import time

from benchdb import PRODUCTION, django_setup, throwaway_database

django_setup(PRODUCTION)

DB_NAME = "gpuportal_bench_hbcpu"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--per-gpu", type=int, default=5, help="samples per GPU per heartbeat")
    ap.add_argument("--count", type=int, default=300, help="heartbeats per round")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    import json

    from django.conf import settings
    from django.test import Client

    from portal.core.context import Actor
    from portal.metrics.services import samples_flush
    from portal.nodes.models import GPU
    from portal.nodes.services import node_add

    settings.ALLOWED_HOSTS = ["*"]
    with throwaway_database(DB_NAME):
        nodes = []
        for i in range(args.nodes):
            node, token = node_add(actor=Actor(user=None, label="manage.py"), name=f"hbc-{i:03d}", gpus="8xH100-80GB")
            uuids = list(GPU.objects.filter(node=node).order_by("index").values_list("uuid", flat=True))
            nodes.append((token, uuids))
        client = Client()

        def body(uuids, k):
            now = time.time()
            return json.dumps({"samples": [
                {"gpu_uuid": u, "ts": now - s, "utilization": (k + s) % 100, "memory_used_mb": 1000 + k,
                 "memory_total_mb": 81920, "temperature_c": 60, "power_w": 300.0, "power_limit_w": 700.0,
                 "ecc_errors": 0, "xid_errors": [], "processes": []}
                for s in range(args.per_gpu) for u in uuids], "jobs": []})

        bodies = [(f"Bearer {t}", body(u, k)) for k, (t, u) in enumerate(nodes)]

        def round_():
            for k in range(args.count):
                auth, data = bodies[k % len(bodies)]
                r = client.post("/api/agent/v1/heartbeat", data, content_type="application/json",
                                HTTP_AUTHORIZATION=auth, secure=True)
                if r.status_code != 200 or r.json()["refused"]:
                    raise SystemExit(f"heartbeat answered {r.status_code}: {r.content[:300]!r}")
            samples_flush()

        round_()  # warm: imports, per-process caches, connections
        best = None
        for _ in range(args.repeat):
            c0 = time.process_time()
            round_()
            best = min(best or 1e9, (time.process_time() - c0) / args.count)
        n = args.per_gpu * 8
        print(f"CPU per heartbeat ({n} samples, {args.nodes} nodes, best of {args.repeat} x {args.count}): "
              f"{best * 1000:.2f} ms in the web process -> at most {1 / best:.0f} heartbeats/s a core")
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile(time.process_time)  # CPU, not time spent waiting
            prof.enable()
            round_()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
