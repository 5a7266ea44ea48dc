"""Resident memory of the portal's processes with a deep queue: gunicorn's workers and the Celery
worker's processes, with 50,000 waiting jobs.

Builds a throwaway PostgreSQL database (`gpuportal_bench_mem`, --db to change) on the DATABASE_URL
server and fills it with bulk inserts: the demo tenants, --nodes nodes of 8 GPUs each busy with one
8-GPU running job (so every queued job waits), and --queued queued jobs of mixed sizes. Then starts
gunicorn (--workers, production settings) and a Celery worker (queues default and scheduler, as the
kit's gpuportal-worker unit, --concurrency processes) on it, and prints each process's resident set
size (VmRSS), its peak (VmHWM) and its proportional share (PSS), three times:

- idle: both started, nothing asked yet;
- after load: the gunicorn workers answered --pages pages of the API's queued jobs (500 a page,
  several clients at once, so every worker serves some), and the Celery worker ran a full
  scheduling pass over the whole queue (snapshot, core, every waiting job's reason and position);
- the same again (memory a second round adds: growth, not the first load).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/x CELERY_BROKER_URL=redis://127.0.0.1:6379/4 \\
        REDIS_URL=redis://127.0.0.1:6379/5 .venv/bin/python bench/memory_bench.py [--queued 50000]

Target (issue 14): report it; a worker's memory should not grow with the queue per request.
"""
import argparse
import os
import random
import socket
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

from benchdb import PRODUCTION, ROOT, django_setup, throwaway_database

django_setup(PRODUCTION)

import requests  # noqa: E402
from django.db import connection  # noqa: E402


def fill(nodes: int, queued: int) -> str:
    """The demo tenants, a fleet all busy, `queued` waiting jobs; returns an API token of alice."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.utils import timezone

    from portal.accounts.services import token_issue
    from portal.core.context import Actor
    from portal.jobs.models import Allocation, Job
    from portal.nodes.models import GPU, Node
    from portal.tenancy.models import Organization, Project, Quota

    call_command("seed_demo", stdout=open(os.devnull, "w"))
    Quota.objects.update(guaranteed_gpus=Decimal(3000), max_gpus=Decimal(8000), max_running_jobs=None,
                         gpu_hours_budget=None)
    Organization.objects.update(max_gpus=None)
    projects = list(Project.objects.order_by("pk"))
    users = {p.pk: get_user_model().objects.filter(memberships__project=p, memberships__role__in=["owner", "member"])
             .first() for p in projects}
    now = timezone.now()
    fleet = Node.objects.bulk_create([Node(name=f"m{i:04d}", state="ready", last_heartbeat_at=now,
                                           queue_verified_at=now) for i in range(nodes)])
    gpus = GPU.objects.bulk_create([GPU(node=n, index=g, uuid=f"GPU-mem-{n.name}-{g}", model="H100-80GB",
                                        memory_mb=81920) for n in fleet for g in range(8)])
    running = Job.objects.bulk_create([
        Job(project=projects[i % 2], user=users[projects[i % 2].pk], name="busy", image="x", command=["true"],
            gpus=8, time_limit_s=86400, state="running", started_at=now, node=n) for i, n in enumerate(fleet)])
    Allocation.objects.bulk_create([Allocation(job=job, attempt=1, gpu=gpus[i * 8 + g], started_at=now)
                                    for i, job in enumerate(running) for g in range(8)])
    rng = random.Random(14)
    sizes = [1] * 50 + [2] * 20 + [4] * 15 + [8] * 15
    Job.objects.bulk_create([
        Job(project=projects[i % 2], user=users[projects[i % 2].pk], name=f"q{i}", image="gpuportal/busybox:latest",
            command=["python", "train.py", f"--seed={i}"], gpus=rng.choice(sizes),
            time_limit_s=rng.choice([600, 3600, 4 * 3600, 86400]),
            priority=rng.choice(["low", "normal", "normal", "high"]), reason_code="new")
        for i in range(queued)], batch_size=5000)
    alice = get_user_model().objects.get(username="alice")
    _, token = token_issue(actor=Actor(user=alice), user=alice, name="memory-bench", scopes=["read"])
    return token


def rss(pid: int) -> tuple[float, float, float]:
    """(VmRSS, VmHWM, Pss) of a process in MiB; zeros once it is gone. RSS counts the pages a
    forked worker still shares with its parent (gunicorn preloads the portal) in full; PSS splits
    them among the sharers, so PSS adds up to what the processes take together."""
    values = {}
    for name in ("status", "smaps_rollup"):
        try:
            for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "Pss"):
                    values[key] = int(rest.split()[0]) / 1024
        except OSError:
            pass
    return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0), values.get("Pss", 0.0)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def report(title: str, web: int, worker: int) -> None:
    rows = [("gunicorn master", web)] + [(f"gunicorn worker {i + 1}", p) for i, p in enumerate(children(web))]
    rows += [("celery main", worker)] + [(f"celery pool {i + 1}", p) for i, p in enumerate(children(worker))]
    print(f"{title}:")
    for name, pid in rows:
        now, peak, pss = rss(pid)
        print(f"  {name:18s} pid {pid:7d}  RSS {now:7.1f} MiB  peak {peak:7.1f} MiB  PSS {pss:7.1f} MiB")
    for what, top in (("web", web), ("worker", worker)):
        sizes = [rss(p) for p in [top, *children(top)]]
        print(f"  {what} in all: RSS {sum(x[0] for x in sizes):.0f} MiB, PSS {sum(x[2] for x in sizes):.0f} MiB")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.5)


def load(base: str, token: str, pages: int, workers: int) -> None:
    """Each round sends enough requests that every gunicorn worker (sync: one request at a time)
    serves several: the queued jobs' API pages and the jobs page, from `workers` clients at once."""
    from concurrent.futures import ThreadPoolExecutor

    def api(page: int) -> int:
        r = requests.get(f"{base}/api/v1/jobs/", params={"state": "queued", "page_size": 500, "page": page},
                         headers={"Authorization": f"Bearer {token}"}, timeout=120)
        if r.status_code != 200:
            raise SystemExit(f"GET /api/v1/jobs/ page {page}: HTTP {r.status_code} {r.text[:200]}")
        return r.json()["count"]

    last = max(1, -(-api(1) // 500))  # the user's queued jobs, 500 a page
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(api, [1 + (k % last) for k in range(pages)]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queued", type=int, default=50_000)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4, help="gunicorn workers")
    ap.add_argument("--concurrency", type=int, default=2, help="Celery worker processes")
    ap.add_argument("--pages", type=int, default=40, help="API pages of queued jobs a round asks for")
    ap.add_argument("--db", default="gpuportal_bench_mem")
    args = ap.parse_args()

    from portal.jobs.models import Job

    procs: list[subprocess.Popen] = []
    with throwaway_database(args.db) as name:
        try:
            t0 = time.perf_counter()
            token = fill(args.nodes, args.queued)
            print(f"{args.queued} queued jobs, {args.nodes} nodes x 8 GPUs all busy, in {time.perf_counter() - t0:.0f} s "
                  f"(database {name})")
            db = connection.settings_dict
            env = {**os.environ, "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{name}",
                   "DEBUG": "0", "ALLOWED_HOSTS": "127.0.0.1,localhost", "SECURE_SSL_REDIRECT": "0",
                   "LOG_LEVEL": "WARNING",
                   # Every pass full: each round clears the queue's positions behind the scheduler's
                   # back, which a pass that finds nothing changed would leave as they are.
                   "SCHEDULER_REPLAN_S": "0",
                   # No mail: the bench has no SMTP server, and ends nobody asked to hear of.
                   "EMAIL_BACKEND": "django.core.mail.backends.locmem.EmailBackend"}
            port = free_port()
            web = subprocess.Popen([sys.executable, "-m", "gunicorn", "portal.wsgi", "-b", f"127.0.0.1:{port}",
                                    "-w", str(args.workers), "--preload", "--timeout", "300", "--log-level", "warning"],
                                   cwd=ROOT, env=env)
            procs.append(web)
            worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "portal", "--quiet", "worker",
                                       "-Q", "default,scheduler", "--concurrency", str(args.concurrency),
                                       "-n", f"membench-{os.getpid()}@%h", "--loglevel", "WARNING"],
                                      cwd=ROOT, env=env)
            procs.append(worker)
            base = f"http://127.0.0.1:{port}"

            def web_up() -> bool:
                try:
                    return requests.get(f"{base}/login/", timeout=10).status_code == 200
                except requests.RequestException:
                    return False

            wait_for(web_up, 180, "gunicorn answering")
            wait_for(lambda: len(children(worker.pid)) >= args.concurrency, 180, "Celery worker's pool")
            time.sleep(2)  # the pool's processes finish importing
            report("idle", web.pid, worker.pid)

            from portal.core.queue import SCHEDULE_PASS, send

            for round_ in (1, 2):
                Job.objects.filter(state="queued").update(queue_position=None)
                t = time.perf_counter()
                if not send(SCHEDULE_PASS, queue="scheduler"):
                    raise SystemExit("could not queue a scheduling pass: is CELERY_BROKER_URL's Redis up?")
                load(base, token, args.pages, args.workers * 2)
                wait_for(lambda: not Job.objects.filter(state="queued", queue_position__isnull=True).exists(), 600,
                         "the scheduling pass placing every waiting job in the queue")
                print(f"round {round_}: {args.pages} API pages of 500 queued jobs and one full pass over "
                      f"{Job.objects.filter(state='queued').count()} waiting jobs, {time.perf_counter() - t:.0f} s")
                report(f"after round {round_}", web.pid, worker.pid)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            connection.close()


if __name__ == "__main__":
    main()
