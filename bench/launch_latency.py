"""Launch latency of a sandbox: from ``driver.launch`` to the job's process
running, over N runs, as p50/p99.

    .venv/bin/python bench/launch_latency.py [--runs 30] [--image gpuportal/busybox:latest]
    .venv/bin/python bench/launch_latency.py --sandbox kvm [--runs 5]
    .venv/bin/python bench/launch_latency.py --gang-network   # docker: rank 0 of a multi-node gang

Two figures per run: ``launch`` (the call returned: container created and
started, so runc has exec'd the job) and ``first_output`` (the job's first line
is readable through the driver, polled every 5 ms: the process really ran).
With ``--agent N`` it measures the whole agent instead of the driver: N CPU jobs launched
through ``Agent.launch`` on ``--concurrency`` threads (the agent's Celery pool), submitted
``--rate`` a second (0: all at once), with the supervisor running as in production and a
portal stand-in in the same process that answers at once. It prints submit to running (the
launch message's arrival to the agent's ``running`` report), running to terminal for the
job's command (``true``: how soon the agent learns of an exit and reports it), where a launch's
time goes (the wait for a launch thread, the driver's launch, and in it the engine's create and
start calls), the requests carrying job events per job, and the node's CPU per job: the agent's process,
the node's supervisor (docker; one process for all containers), and dockerd plus containerd
(process sandbox: the agent and its job wrappers). ``--no-watch`` turns off exit watching
(pidfd, Docker events), so the supervisor's 1 s tick notices exits, as before it existed.

    .venv/bin/python bench/launch_latency.py --agent 200 [--rate 0] [--sandbox process]

Needs the engine and image from .ci/docker.sh; ``--sandbox kvm`` needs libvirtd
and the guest image from .ci/kvm.sh (a real VM per run: the whole boot is in
``first_output``; ``launch`` is libvirt's createXML). ``--gang-network``
launches each run as rank 0 of a gang whose project allows network, so the
figures include making the job-private network (internal: no traffic leaves).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from agents.sandbox import LaunchSpec  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))]


class PortalStandIn:
    """Answers the agent's API calls at once and notes when each job reported what."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.times: dict[tuple[str, str], float] = {}
        self.lease_renewed_at = time.monotonic()
        self.last_contact = None
        self.event_requests = 0  # requests carrying job events (a batch counts once)

    def confirm(self, job_id, attempt):
        return {}

    def event(self, job_id, attempt, state, **_):
        with self.lock:
            self.event_requests += 1
            self.times.setdefault((job_id, state), time.perf_counter())
        return {"result": "applied"}

    def event_batch(self, reports):
        """Protocol 1.2's batch, as the portal answers it."""
        with self.lock:
            self.event_requests += 1
            for r in reports:
                self.times.setdefault((r["job_id"], r["state"]), time.perf_counter())
        return [{"job_id": r["job_id"], "result": "applied"} for r in reports]

    def logs(self, job_id, attempt, offset, data):
        return {"stored": True, "size": offset + len(data), "full": False}

    def heartbeat(self, **_):
        self.lease_renewed_at = time.monotonic()
        return {"drain": False, "stop": []}


def _cpu_of(names: tuple[str, ...]) -> float:
    """CPU seconds used so far by the processes with these command names (dockerd, containerd)."""
    from pathlib import Path

    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if text[text.index("(") + 1:text.rindex(")")] in names:
            fields = text.rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _time_phases(agent, driver) -> dict:
    """Where a launch's time goes: when each job's launch began (it waited for one of the agent's
    launch threads until then) and how long the driver's launch and, in it, the engine's create and
    start calls took (docker), by job id. Wraps the methods of these two objects only."""
    import threading

    phases: dict = {"began": {}, "driver": {}, "create": {}, "start": {}}
    lock = threading.Lock()
    current = threading.local()

    def timed(obj, name, key, job_of=None):
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            job = job_of(*a) if job_of else getattr(current, "job", None)
            if key == "began":
                current.job = job
                with lock:
                    phases[key][job] = time.perf_counter()
                return inner(*a, **k)
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                with lock:
                    phases[key][job] = time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(agent, "launch", "began", job_of=lambda job_id, *_: job_id)
    timed(driver, "launch", "driver", job_of=lambda spec: spec.job_id)
    api = getattr(getattr(driver, "client", None), "api", None)
    if api is not None:  # docker: the engine's two calls (docker-py's create goes through create_container)
        timed(api, "create_container", "create")
        timed(api, "start", "start")
    return phases


def _print_phases(phases: dict, submitted: dict) -> None:
    waited = [(phases["began"][j] - t) * 1000 for j, t in submitted.items() if j in phases["began"]]
    print(f"  where it goes: waiting for a launch thread p50 {statistics.median(waited):7.0f} ms, "
          + ", ".join(f"{name} p50 {statistics.median(xs) * 1000:.0f} ms"
                      for name, xs in (("driver launch", list(phases["driver"].values())),
                                       ("engine create", list(phases["create"].values())),
                                       ("engine start", list(phases["start"].values()))) if xs))


def agent_mode(args) -> None:
    import tempfile
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from agents.probe.sim import SimProbe
    from agents.worker import Agent

    node = f"bench-{uuid.uuid4().hex[:6]}"
    state = tempfile.mkdtemp(prefix="gpuportal-bench-")
    if args.sandbox == "process":
        from agents.sandbox.process_driver import ProcessDriver

        driver = ProcessDriver(node=node, state_dir=state)
        engine = ()
    else:
        from agents.sandbox.docker_driver import DockerDriver

        driver = DockerDriver(node=node, state_dir=state, supervise=True)
        engine = ("dockerd", "containerd")
    if args.no_watch:
        driver.watch_exits = None
    portal = PortalStandIn()
    agent = Agent(name=node, client=portal, driver=driver, probe=SimProbe("1xH100-80GB", node_name=node),
                  stop_grace_s=1.0, scrub_gpus=False)
    agent.lease_s = 3600.0
    if hasattr(driver, "lease_path"):
        driver.lease_s = agent.lease_s
    agent.write_lease()
    stop = threading.Event()
    sup = threading.Thread(target=agent.run_supervisor, args=(stop,), daemon=True)
    sup.start()
    spec = {"image": args.image, "command": ["true"], "cpus": 0.1, "memory_mb": 64, "time_limit_s": 600}
    submitted: dict[str, float] = {}
    phases = _time_phases(agent, driver)
    engine_cpu, own = _cpu_of(engine), os.times()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        for i in range(args.agent):
            job_id = f"b{i}"
            if args.rate:
                time.sleep(max(0.0, t0 + i / args.rate - time.perf_counter()))
            submitted[job_id] = time.perf_counter()
            pool.submit(agent.launch, job_id, 1, spec)
    deadline = time.monotonic() + 600
    while len([k for k in portal.times if k[1] in ("succeeded", "failed")]) < args.agent:
        if time.monotonic() > deadline:
            raise SystemExit("not every job ended within 600 s")
        time.sleep(0.05)
    makespan = time.perf_counter() - t0
    while agent.jobs():  # reported; their sandboxes are being removed
        time.sleep(0.05)
    stop.set()
    agent._wake.set()
    sup.join(10)
    sup_proc = getattr(driver, "node_supervisor", None)
    if sup_proc is not None:  # the docker node's supervisor waits for the next launch: end it, so its CPU counts
        sup_proc.terminate()
        sup_proc.wait(30)
    after = os.times()
    engine_cpu = _cpu_of(engine) - engine_cpu
    agent_cpu = (after.user + after.system) - (own.user + own.system)
    children_cpu = (after.children_user + after.children_system) - (own.children_user + own.children_system)
    to_running = [(portal.times[(j, "running")] - t) * 1000 for j, t in submitted.items()]
    to_end = [(min(v for (j2, s), v in portal.times.items() if j2 == j and s in ("succeeded", "failed"))
               - portal.times[(j, "running")]) * 1000 for j in submitted]
    n = args.agent
    print(f"{args.sandbox} sandbox, {n} jobs running `true` through one agent ({args.concurrency} launch threads, "
          f"{'all at once' if not args.rate else f'{args.rate:g}/s'}, exit watching "
          f"{'off: 1 s tick' if args.no_watch else 'on'}), makespan {makespan:.1f} s")
    for name, xs in (("submit to running", to_running), ("running to terminal", to_end)):
        print(f"  {name:20s} p50 {statistics.median(xs):7.0f} ms   p99 {pct(xs, 99):7.0f} ms   max {max(xs):7.0f} ms")
    per = 1000 / n
    _print_phases(phases, submitted)
    print(f"  event requests per job {portal.event_requests / n:.2f} (starting, running and the end: 3 unbatched)")
    print(f"  node CPU per job {(agent_cpu + children_cpu + engine_cpu) * per:.1f} ms: agent {agent_cpu * per:.1f}, "
          f"{'node supervisor' if args.sandbox == 'docker' else 'job wrappers'} {children_cpu * per:.1f}"
          + (f", dockerd+containerd {engine_cpu * per:.1f} (shims not counted)" if engine else "")
          + f" (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    shutil.rmtree(state, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandbox", choices=("docker", "kvm", "process"), default="docker")
    ap.add_argument("--agent", type=int, default=0, metavar="N", help="N jobs through the whole agent")
    ap.add_argument("--concurrency", type=int, default=4, help="--agent: launch threads (the agent's default)")
    ap.add_argument("--rate", type=float, default=0.0, help="--agent: submits a second (0: all at once)")
    ap.add_argument("--no-watch", action="store_true", help="--agent: notice exits by the 1 s tick only")
    ap.add_argument("--runs", type=int, default=None, help="default: 30 (docker), 5 (kvm)")
    ap.add_argument("--image", default="gpuportal/busybox:latest")
    ap.add_argument("--gang-network", action="store_true", help="docker: each run makes and joins a job network")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    if args.agent:
        return agent_mode(args)
    if args.sandbox == "process":
        ap.error("--sandbox process: only with --agent")
    if args.runs is None:
        args.runs = 30 if args.sandbox == "docker" else 5
    node = f"bench-{uuid.uuid4().hex[:6]}"
    if args.sandbox == "kvm":
        import logging

        from agents.sandbox.kvm_driver import KvmDriver

        logging.basicConfig(level=logging.WARNING, format="%(message)s")  # says which domain type and why
        driver = KvmDriver(node=node)
        memory_mb, wait_s, what = 256, 120, f"domain type {driver.domain_type}"
    else:
        from agents.sandbox.docker_driver import DockerDriver

        driver = DockerDriver(node=node, gang_network_internal=True)
        memory_mb, wait_s, what = 64, 30, args.image + (", gang network" if args.gang_network else "")
    launch_ms, first_ms = [], []
    for i in range(args.runs + 1):  # run 0 warms the image cache and is not counted
        spec = LaunchSpec(job_id=f"bench-{i}", attempt=1, image=args.image,
                          command=["sh", "-c", "echo up; sleep 30"], cpus=1, memory_mb=memory_mb, time_limit_s=60,
                          network=args.gang_network, rendezvous={"NODE_RANK": 0, "WORLD_SIZE": 2}
                          if args.gang_network else None)
        t0 = time.perf_counter()
        h = driver.launch(spec)
        t1 = time.perf_counter()
        while not driver.read_logs(h, 0).startswith(b"up"):
            if time.perf_counter() - t0 > wait_s:
                driver.remove(h)
                raise SystemExit(f"job produced no output in {wait_s} s")
            time.sleep(0.005)
        t2 = time.perf_counter()
        driver.stop(h, 0)
        driver.remove(h)
        if i:
            launch_ms.append((t1 - t0) * 1000)
            first_ms.append((t2 - t0) * 1000)
    if args.sandbox == "kvm":
        shutil.rmtree(driver.log_dir, ignore_errors=True)  # the consoles of the runs
    res = {name: {"p50_ms": round(statistics.median(xs), 1), "p99_ms": round(pct(xs, 99), 1),
                  "min_ms": round(min(xs), 1), "max_ms": round(max(xs), 1)}
           for name, xs in (("launch", launch_ms), ("first_output", first_ms))}
    res["runs"] = args.runs
    res["sandbox"] = args.sandbox
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.sandbox} sandbox launch latency over {args.runs} runs ({what})")
    for name in ("launch", "first_output"):
        r = res[name]
        print(f"  {name:13s} p50 {r['p50_ms']:7.1f} ms   p99 {r['p99_ms']:7.1f} ms   "
              f"min {r['min_ms']:7.1f} ms   max {r['max_ms']:7.1f} ms")


if __name__ == "__main__":
    main()
