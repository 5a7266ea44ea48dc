"""What a job's image costs its launch on a docker node (agents/sandbox/images.py): a pull from a registry
with a login (uncached), a launch whose project already pulled it (cached: one engine lookup and the
cache's record), and another project's first launch of a cached image (the registry checks its login;
only the manifest moves). Against a real registry on loopback (Debian's docker-registry, as the tests
start it) and the real engine; the image is the busybox job image plus one file (a few MB).

    .venv/bin/python bench/image_pull_bench.py [--rounds 5]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import docker  # noqa: E402

from agents.sandbox.images import ImageCache  # noqa: E402
from tests.registry import LOGINS, start_registry, stop_registry  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    engine = docker.from_env()
    (user, password), = LOGINS.items()
    login = lambda: {"registry": "", "username": user, "password": password}  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        registry = start_registry(Path(tmp) / "registry", LOGINS)
        refs = []
        try:
            cache = ImageCache(engine, node="bench", state_path=Path(tmp) / "images.json")
            uncached, cached, other = [], [], []
            for i in range(args.rounds):
                ref = registry.push_image(engine)
                refs.append(ref)
                uncached.append(timed(lambda: cache.ensure(ref, project_id=1, credentials=login)))
                cached.append(timed(lambda: cache.ensure(ref, project_id=1, credentials=login)))
                other.append(timed(lambda: cache.ensure(ref, project_id=2, credentials=login)))
            size = cache.records()[refs[0]]["size"]
        finally:
            for ref in refs:
                try:
                    engine.images.remove(ref, force=True)
                except docker.errors.DockerException:
                    pass
            stop_registry(registry)
    print(f"image of {size / 1e6:.1f} MB, {args.rounds} rounds, median (min-max) ms, on {os.cpu_count()} CPUs:")
    for name, values in (("uncached: pull with the project's login", uncached),
                         ("cached, same project (no pull)", cached),
                         ("cached, another project (login checked, manifest only)", other)):
        print(f"  {name:58s} {statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
