"""A whole gpuportal installation of its own, for the fault suite: a throwaway PostgreSQL cluster
and a redis-server on free ports, the portal under gunicorn with deploy's config, a Celery
worker and beat, and four agents (process sandbox, simulated GPUs). Where network namespaces can
be made (root), each agent runs in one of its own and reaches the portal and Redis over a veth
pair, so a case can cut one node off by dropping its packets (tests/faults/netns.py).

Every process runs in its own process group (tests.procs) and `close()` stops all of them, the
jobs' sandboxes included, whatever happened. The process sandbox starts each job in a session of
its own, so a job outlives its agent's death; `close()` finds the jobs by the ground-truth
folder named on their command line.
"""
import glob
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.faults import netns
from tests.procs import start_process, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
AGENTS = 4
GPUS_PER_AGENT = 4
# Fast timers so a case takes seconds, with the portal's own rule between them kept
# (NODE_TIMEOUT_S >= AGENT_LEASE_S + AGENT_FENCE_GRACE_S + 2).
# An agent restarted after 8 s (the case) is back within NODE_TIMEOUT_S.
TIMERS = {"NODE_HEARTBEAT_INTERVAL_S": "1", "AGENT_LEASE_S": "6", "AGENT_FENCE_GRACE_S": "1",
          "NODE_TIMEOUT_S": "10", "NODE_REAP_INTERVAL_S": "1", "LAUNCH_RESEND_S": "3"}

BOOTSTRAP = """
import json
from django.core.management import call_command
from django.contrib.auth import get_user_model
from portal.accounts.services import token_issue
from portal.core.context import Actor
from portal.nodes.services import node_add
call_command("migrate", verbosity=0)
call_command("seed_demo", verbosity=0)
admin = get_user_model().objects.get(username="admin")
alice = get_user_model().objects.get(username="alice")
out = {"nodes": {}}
for i in range(1, %(agents)d + 1):
    out["nodes"]["fault-%%02d" %% i] = node_add(actor=Actor(user=admin), name="fault-%%02d" %% i)[1]
out["token"] = token_issue(actor=Actor(user=alice), user=alice, name="faults", scopes=["read", "submit"])[1]
print("BOOTSTRAP " + json.dumps(out))
"""

# The metering service run on request (one line on stdin, one line back), with a fresh database
# connection each time: the database may have been restarted since the last run.
# Anything else the portal prints (a log handler on stdout) goes to stderr, the process's log.
METER = """
import json, sys, traceback
answer, sys.stdout = sys.stdout, sys.stderr
import django
django.setup()
from django.db import connections
from portal.billing.services import usage_meter
for _ in sys.stdin:
    try:
        print("METER " + json.dumps(usage_meter()), file=answer, flush=True)
    except Exception:
        traceback.print_exc()
        print("ERROR", file=answer, flush=True)
    connections.close_all()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"{name}: no PostgreSQL server binaries under /usr/lib/postgresql")
    return found[-1]


class Cluster:
    def __init__(self, tmp: Path, timers: dict | None = None):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.truth = tmp / "truth"  # the jobs' own start/tick/end records
        self.truth.mkdir(exist_ok=True)
        self.pgdata = tmp / "pgdata"
        self.pg_port, self.redis_port, self.web_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.web_port}"
        self.dsn = f"host=127.0.0.1 port={self.pg_port} user=postgres dbname=gpuportal"
        self.procs: dict[str, tuple[subprocess.Popen, object]] = {}
        self.pg_user = None  # initdb refuses root: the cluster then belongs to postgres
        self.nodes: dict[str, str] = {}
        self.netns: dict[str, netns.Netns] = {}  # node name -> its agent's namespace (where they can be made)
        self.token = ""
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_"))},
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:{self.pg_port}/gpuportal",
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/1",
            "GPUPORTAL_VAR_DIR": str(tmp / "var"), "DEBUG": "1", "SECRET_KEY": "fault-suite",
            "DJANGO_SETTINGS_MODULE": "portal.settings", "GPUPORTAL_TEST_NODES_SKIP_QUEUE_PROBE": "0",
            "GPUPORTAL_TEST_FAST_HASHER": "1", "API_USER_RATE": "100000/min", "LOG_LEVEL": "INFO",
            "GUNICORN_BIND": f"127.0.0.1:{self.web_port}", "GUNICORN_WORKERS": "2", "GUNICORN_THREADS": "4",
            "GUNICORN_CONTROL_SOCKET": str(tmp / "gunicorn.ctl"), "GUNICORN_LOG_LEVEL": "warning",
            **(TIMERS if timers is None else timers),
        }

    # -- processes ---------------------------------------------------------------------------
    def start(self, key: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{key}.log", "a+")
        proc = start_process(argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        self.procs[key] = (proc, log)
        return proc

    def stop(self, key: str, grace_s: float = 10.0) -> None:
        proc, log = self.procs.pop(key)
        stop_process(proc, grace_s)
        log.close()

    def kill(self, key: str) -> None:
        """SIGKILL the process group, as a crash would (the jobs' sandboxes are not in it)."""
        proc, log = self.procs.pop(key)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        log.close()

    def signal(self, key: str, sig: int) -> None:
        os.killpg(self.procs[key][0].pid, sig)

    def log(self, key: str) -> str:
        path = self.tmp / f"{key}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _as_pg(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self.pg_user, "--", *argv] if self.pg_user else argv

    # -- PostgreSQL and Redis ----------------------------------------------------------------
    def start_postgres(self) -> None:
        if not self.pgdata.exists():
            self.pg_user = "postgres" if os.geteuid() == 0 else None
            self.pgdata.mkdir()
            if self.pg_user:
                shutil.chown(self.pgdata, self.pg_user)
                self.tmp.chmod(0o755)  # postgres must reach its data folder
            subprocess.run(self._as_pg([pg_bin("initdb"), "-D", str(self.pgdata), "-U", "postgres", "-A", "trust",
                                        "--no-sync", "-E", "UTF8"]), check=True, capture_output=True)
        # fsync off: a throwaway cluster; what is tested is the restart, not the disk.
        opts = f"-p {self.pg_port} -k {self.pgdata} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        subprocess.run(self._as_pg([pg_bin("pg_ctl"), "-D", str(self.pgdata), "-l", str(self.pgdata / "server.log"),
                                    "-o", opts, "-w", "-t", "60", "start"]), check=True, capture_output=True)

    def stop_postgres(self, mode: str = "fast") -> None:
        subprocess.run(self._as_pg([pg_bin("pg_ctl"), "-D", str(self.pgdata), "-m", mode, "-w", "stop"]),
                       capture_output=True)

    def start_redis(self) -> None:
        # No persistence: a restart loses every queued message, like F-06 and F-07 together. Protected
        # mode off: it listens on loopback and the agents' veth ends only, and must answer them.
        seen = self.log("redis").count("Ready to accept connections")  # the log is kept across restarts
        self.start("redis", ["redis-server", "--port", str(self.redis_port), "--bind", *self.listen_addrs(),
                             "--protected-mode", "no", "--save", "", "--appendonly", "no"])
        wait_for(lambda: self.log("redis").count("Ready to accept connections") > seen, 30, "redis-server")

    # -- the portal --------------------------------------------------------------------------
    def bootstrap(self) -> None:
        subprocess.run(self._as_pg([os.path.join(os.path.dirname(pg_bin("initdb")), "createdb"), "-h", "127.0.0.1",
                                    "-p", str(self.pg_port), "-U", "postgres", "gpuportal"]), check=True)
        out = subprocess.run([PY, "-c", "import django; django.setup()\n" + BOOTSTRAP % {"agents": AGENTS}],
                             cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=240)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BOOTSTRAP ")), None)
        assert line, out.stdout[-2000:] + out.stderr[-4000:]
        data = json.loads(line[len("BOOTSTRAP "):])
        self.nodes, self.token = data["nodes"], data["token"]

    def start_web(self) -> None:
        binds = [a for addr in self.listen_addrs() for a in ("-b", f"{addr}:{self.web_port}")]
        self.start("web", [PY, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", *binds, "portal.wsgi:application"])

    def wait_web(self) -> None:
        wait_for(self.api_ok, 60, f"gunicorn; log:\n{self.log('web')[-2000:]}")

    def start_worker(self, crashpoint: str = "") -> None:
        """`crashpoint`: the worker SIGKILLs itself there (portal/core/crashpoints.py), e.g. mid-pass."""
        self.start("worker", [PY, "-m", "celery", "-A", "portal", "worker", "-Q", "scheduler,default", "-P", "solo",
                              "-n", "faults@%h", "--loglevel", "INFO"],
                   env={"GPUPORTAL_CRASHPOINTS": "1", "GPUPORTAL_CRASHPOINT": crashpoint} if crashpoint else None)

    def start_beat(self) -> None:
        self.start("beat", [PY, "-m", "celery", "-A", "portal", "beat", "-s", str(self.tmp / "beat-schedule"),
                            "--loglevel", "WARNING"])

    def start_portal(self, wait: bool = True) -> None:
        """gunicorn, the worker and beat started at once (their start-ups overlap); `wait`: until the API answers."""
        self.start_web()
        self.start_worker()
        self.start_beat()
        if wait:
            self.wait_web()

    def stop_portal(self, kill: bool) -> None:
        for key in ("web", "worker", "beat"):
            (self.kill if kill else self.stop)(key)

    def api_ok(self) -> bool:
        try:
            return requests.get(f"{self.url}/api/v1/jobs/?limit=1", headers=self.headers(), timeout=3).status_code == 200
        except requests.RequestException:
            return False

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    # -- agents ------------------------------------------------------------------------------
    def start_agent(self, name: str) -> None:
        ns = self.netns.get(name)
        host = ns.host_addr if ns else "127.0.0.1"  # the portal's and Redis's address as the agent sees them
        broker = f"redis://{host}:{self.redis_port}/0"
        argv = [PY, "-m", "agents", "--portal", f"http://{host}:{self.web_port}", "--token", self.nodes[name],
                "--broker", broker, "--name", name,
                "--gpus", f"sim:{GPUS_PER_AGENT}xH100-80GB", "--sandbox", "process", "--gpu-scrub", "off",
                "--state-dir", str(self.tmp / "agents" / name), "--stop-grace", "1", "--concurrency", "8"]
        self.start(name, ns.argv(argv) if ns else argv, env={"CELERY_BROKER_URL": broker})

    def listen_addrs(self) -> list[str]:
        return ["127.0.0.1", *(ns.host_addr for ns in self.netns.values())]

    def partition(self, name: str, on: bool) -> None:
        """Drop every packet between node `name`'s agent and the portal side (or stop dropping them)."""
        if name not in self.netns:
            raise RuntimeError(f"cutting a node off needs network namespaces: {netns.available() or 'not made'}")
        self.netns[name].partition(on)

    def agent_alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name][0].poll() is None

    def wait_nodes_ready(self, names, timeout=90) -> None:
        names = list(names)
        # Each has heartbeated within its interval (and a margin): with the bench's 5 s interval a
        # fixed 3 s window held for all 16 nodes only while their heartbeats stayed in step.
        fresh_s = 2 * float(self.env.get("NODE_HEARTBEAT_INTERVAL_S", "5")) + 1  # 5: the portal's default
        wait_for(lambda: set(names) <= set(self.sql(
            "SELECT name FROM nodes_node WHERE state = 'ready' AND queue_verified_at IS NOT NULL "
            "AND last_heartbeat_at > now() - make_interval(secs => %s)", (fresh_s,), col=0)), timeout,
            f"nodes {names} to be ready; agent log:\n{self.log(names[0])[-3000:]}")

    def start_all(self) -> None:
        if not netns.available():
            names = [f"fault-{i:02d}" for i in range(1, AGENTS + 1)]  # as BOOTSTRAP names them
            self.netns = dict(zip(names, netns.make(AGENTS)))
            self.env["ALLOWED_HOSTS"] = ",".join(["localhost", *self.listen_addrs()])
        self.start_postgres()
        self.start_redis()
        self.bootstrap()
        # Every process started at once, then waited for: their start-ups overlap (an agent that finds
        # gunicorn not yet up retries its registration).
        self.start_portal(wait=False)
        for name in self.nodes:
            self.start_agent(name)
        self.start_meter()
        self.wait_web()
        self.wait_nodes_ready(self.nodes, timeout=150)

    # -- database ----------------------------------------------------------------------------
    def sql(self, query: str, params=(), col: int | None = None):
        import psycopg

        with psycopg.connect(self.dsn, connect_timeout=5, autocommit=True) as conn:
            rows = conn.execute(query, params).fetchall()
        return [r[col] for r in rows] if col is not None else rows

    def start_meter(self) -> None:
        """The process `meter()` asks, started once: Django's start-up costs a case seconds on a busy
        machine, the metering itself milliseconds."""
        log = open(self.tmp / "meter.log", "a+")
        proc = start_process([PY, "-u", "-c", METER], cwd=ROOT, env=self.env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=log, text=True)
        self.procs["meter"] = (proc, log)

    def meter(self) -> dict:
        """Run the metering service to now (what beat's billing.meter_usage does every minute)."""
        if "meter" not in self.procs or self.procs["meter"][0].poll() is not None:
            if "meter" in self.procs:
                self.procs.pop("meter")[1].close()
            self.start_meter()
        proc = self.procs["meter"][0]
        proc.stdin.write("meter\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("METER "), f"the metering run failed: {line!r}; log:\n{self.log('meter')[-3000:]}"
        return json.loads(line[len("METER "):])

    # -- cleanup -----------------------------------------------------------------------------
    def job_pids(self) -> list[int]:
        """Live job processes of this cluster: a `start` line names its shell's pid."""
        pids = []
        for f in self.truth.iterdir():
            for line in f.read_text().splitlines():
                parts = line.split()
                if parts and parts[0] == "start" and len(parts) >= 4:
                    pid = int(parts[3])
                    try:
                        if str(self.truth).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                            pids.append(pid)
                    except OSError:
                        pass
        return pids

    def close(self) -> None:
        for key in list(self.procs):  # all asked at once, then each waited for: the grace runs once, not per process
            for sig in (signal.SIGCONT, signal.SIGTERM):  # a frozen agent cannot stop otherwise
                try:
                    os.killpg(self.procs[key][0].pid, sig)
                except ProcessLookupError:
                    pass
        for key in list(self.procs):  # a throwaway cluster: nothing to finish, so a short grace
            self.stop(key, grace_s=2)
        for pid in self.job_pids():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)  # the sandbox's own session
            except ProcessLookupError:
                pass
        if self.pgdata.exists():
            self.stop_postgres("immediate")
        for ns in self.netns.values():
            ns.delete()
