"""Launch latency of a sandbox: from ``driver.launch`` to the job's process
running, over N runs, as p50/p99.

    .venv/bin/python bench/launch_latency.py [--runs 30] [--image gpuportal/busybox:latest]
    .venv/bin/python bench/launch_latency.py --sandbox kvm [--runs 5]
    .venv/bin/python bench/launch_latency.py --gang-network   # docker: rank 0 of a multi-node gang

Two figures per run: ``launch`` (the call returned: container created and
started, so runc has exec'd the job) and ``first_output`` (the job's first line
is readable through the driver, polled every 5 ms: the process really ran).
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandbox", choices=("docker", "kvm"), default="docker")
    ap.add_argument("--runs", type=int, default=None, help="default: 30 (docker), 5 (kvm)")
    ap.add_argument("--image", default="gpuportal/busybox:latest")
    ap.add_argument("--gang-network", action="store_true", help="docker: each run makes and joins a job network")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
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
