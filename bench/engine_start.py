"""What the engine's start of one job container costs, by network: a hardened job container (the
docker driver's own create options) created and started one at a time, as p50 and min of create +
start, for ``disabled`` (what a job without network gets: networking off, runc's namespace with
loopback), ``none`` (the engine's none network, what it got before) and the default ``bridge``,
alternated.

    .venv/bin/python bench/engine_start.py [--runs 15] [--rounds 2]

Docker 28 gives a ``--network none`` container a ``libnetwork-setkey`` prestart hook (runc execs the
dockerd binary to hand the namespace back), which neither of the others gets: this shows what that
costs per start on this machine (docs/design.md section 10). Needs the engine and image from
.ci/docker.sh; the containers run ``sleep 60`` and are removed after each round.
"""

import argparse
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from agents.sandbox import LaunchSpec  # noqa: E402
from agents.sandbox.docker_driver import DockerDriver  # noqa: E402


def one_round(driver: DockerDriver, mode: str, runs: int, image: str) -> list[float]:
    took, made = [], []
    try:
        for _ in range(runs):
            spec = LaunchSpec(job_id=f"bench-{uuid.uuid4().hex[:8]}", attempt=1, image=image,
                              command=["sleep", "60"], cpus=0.1, memory_mb=64, time_limit_s=60)
            kwargs = driver._create_kwargs(spec)
            if mode != "disabled":
                kwargs["network_mode"], kwargs["network_disabled"] = mode, False
            t = time.perf_counter()
            cid = driver._create(kwargs)
            made.append(cid)
            driver.client.api.start(cid)
            took.append((time.perf_counter() - t) * 1000)
    finally:
        for cid in made:
            driver._force_remove(cid)
    return took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15, help="containers a round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternated")
    ap.add_argument("--image", default="gpuportal/busybox:latest")
    args = ap.parse_args()
    driver = DockerDriver(node=f"bench-{uuid.uuid4().hex[:6]}")
    print(f"create + start of one hardened job container at a time, {args.runs} a round "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for r in range(args.rounds):
        for mode in ("disabled", "none", "bridge"):
            xs = one_round(driver, mode, args.runs, args.image)
            print(f"  round {r + 1} network {mode:8s} p50 {statistics.median(xs):6.0f} ms   min {min(xs):6.0f} ms")


if __name__ == "__main__":
    main()
