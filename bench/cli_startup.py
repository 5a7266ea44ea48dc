"""gpuctl start-up: median wall and CPU time of new processes, for --help and submit.

    .venv/bin/python bench/cli_startup.py [--runs 15] [--tree /other/checkout ...]

`submit` runs against an unreachable portal (GPUCTL_URL=http://127.0.0.1:1, no token), so it
measures what a submit costs before its one request: start-up, option parsing, spec building.
Each --tree (a checkout, e.g. `git worktree add /tmp/cli-base HEAD~1`) is measured in the same
loop, runs interleaved, so a loaded machine weighs on every tree alike. Target: under 150 ms.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "--help": ["--help"],
    "list": ["list"],
    "submit": ["submit", "-p", "vision", "--image", "x", "--gpus", "1", "--", "true"],
}


def run_once(tree: Path, args: list[str], env: dict) -> tuple[float, float]:
    """Wall time, and the CPU (user + system) of that one child as os.wait4 reports it: on a loaded
    machine the wall time is mostly waiting for a core, the CPU time is what gpuctl costs."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "portal.cli", *args], cwd=tree, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(child.pid, 0)
    child.returncode = 0  # reaped here; keeps Popen from waiting again
    wall = time.perf_counter() - start
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--tree", action="append", default=[], help="another checkout to measure alongside")
    opts = parser.parse_args()
    trees = [REPO] + [Path(t).resolve() for t in opts.tree]
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "GPUCTL_URL": "http://127.0.0.1:1", "GPUCTL_CONFIG": f"{home}/config.json",
               "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("GPUCTL_TOKEN", None)
        samples = {(t, c): [] for t in trees for c in COMMANDS}
        load_before = os.getloadavg()[0]
        for tree in trees:  # compile .pyc files once, outside the measured runs
            subprocess.run([sys.executable, "-m", "compileall", "-q", "portal/cli"], cwd=tree, check=True)
        for _ in range(opts.runs):
            for name, args in COMMANDS.items():
                for tree in trees:
                    samples[tree, name].append(run_once(tree, args, {**env, "PYTHONPATH": str(tree)}))
    print(f"gpuctl start-up, median of {opts.runs} runs (load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after)")
    print(f"{'tree':<24} {'command':<10} {'wall ms':>8} {'cpu ms':>8} {'cpu min':>8}")
    for (tree, name), runs in samples.items():
        wall = statistics.median(w for w, _ in runs) * 1000
        cpu = statistics.median(c for _, c in runs) * 1000
        print(f"{str(tree)[-24:]:<24} {name:<10} {wall:8.0f} {cpu:8.0f} {min(c for _, c in runs) * 1000:8.0f}")


if __name__ == "__main__":
    main()
