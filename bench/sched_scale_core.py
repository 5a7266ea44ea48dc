"""Time one scheduling pass at scale: 10,000 queued jobs, 1,000 nodes x 8 GPUs,
about half the GPUs busy. Run: `.venv/bin/python bench/sched_scale_core.py`.
Target: under 1 s per pass."""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.core import GPU, Allocation, Config, Job, Node, ProjectQuota, Snapshot, schedule  # noqa: E402

SIZES = [(1, 0.55), (2, 0.15), (4, 0.12), (8, 0.12), (16, 0.04), (32, 0.02)]
LIMITS = [3600, 4 * 3600, 12 * 3600, 24 * 3600, 72 * 3600]


def build(n_nodes: int, n_jobs: int, busy: float, seed: int, policy: str) -> Snapshot:
    rng = random.Random(seed)
    now = 1_000_000.0
    nodes = [Node(f"n{i:04d}", "default",
                  [GPU(f"n{i:04d}-{k}", f"n{i:04d}", k, "H100", 81920, load=rng.random()) for k in range(8)])
             for i in range(n_nodes)]
    projects = {f"p{i}": ProjectQuota(f"p{i}", f"o{i % 5}", guaranteed_gpus=n_nodes * 8 / 20,
                                      max_gpus=n_nodes * 8) for i in range(20)}
    sizes, weights = zip(*SIZES)
    running = []
    target = int(n_nodes * 8 * busy)
    free = {n.name: list(n.gpus) for n in nodes}
    order = [n.name for n in nodes]
    rng.shuffle(order)
    used, jid = 0, 0
    for name in order:  # fill nodes with 1/2/4/8-GPU jobs until about half is busy
        while free[name] and used < target:
            g = min(rng.choice([1, 2, 4, 8]), len(free[name]))
            gpus, free[name] = free[name][:g], free[name][g:]
            p = f"p{rng.randrange(20)}"
            job = Job(f"r{jid}", p, projects[p].org, "u", g, now - 7200, rng.choice(LIMITS))
            running.append(Allocation(job, [x.id for x in gpus], now - rng.uniform(0, 7000), borrowed=rng.random() < .2))
            used += g
            jid += 1
    queued = []
    for i in range(n_jobs):
        p = f"p{rng.randrange(20)}"
        queued.append(Job(f"q{i}", p, projects[p].org, "u", float(rng.choices(sizes, weights)[0]),
                          now - rng.uniform(0, 86400), float(rng.choice(LIMITS)), qos=rng.randrange(3)))
    usage = {p: rng.uniform(0, 1e7) for p in projects}
    return Snapshot(now, nodes, running, queued, projects, {}, usage, Config(policy=policy))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--busy", type=float, default=0.5)
    ap.add_argument("--policy", default="multifactor")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    snap = build(args.nodes, args.jobs, args.busy, args.seed, args.policy)
    busy = sum(len(a.gpu_ids) for a in snap.running)
    print(f"{args.nodes} nodes x 8 GPUs, {busy} busy ({busy / (args.nodes * 8):.0%}), "
          f"{len(snap.running)} running, {len(snap.queued)} queued, policy {args.policy}")
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        plan = schedule(snap)
        times.append(time.perf_counter() - t0)
    started = sum(len(s.gpu_ids) for s in plan.starts)
    print(f"plan: {len(plan.starts)} starts ({started} GPUs), {len(plan.preemptions)} preemptions, "
          f"{len(plan.reservations)} reservations, {len(plan.waiting)} waiting with reasons")
    print(f"pass time: best {min(times):.3f} s, worst {max(times):.3f} s over {args.repeat} runs (target < 1 s)")


if __name__ == "__main__":
    main()
