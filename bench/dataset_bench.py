"""Start time of a job with an uncached vs a cached dataset, and the dataset cache's bookkeeping per launch.

A real agent (agents.worker.Agent) with the process sandbox and a real dataset cache (agents/datasets.py)
launches a job naming one dataset of --mb MB served by an HTTP server on loopback (as a bucket's presigned
URLs or an archive URL are fetched): the first launch downloads, hashes and stores it, the second finds it
cached. The portal's side is an in-process stand-in (confirm, events, progress answer at once), so the
figures are the node's own: from the launch command to the sandbox running.

    .venv/bin/python bench/dataset_bench.py [--mb 512] [--entries 1000] [--launches 200]

Bookkeeping: the cost of a cache hit and its release (the index written each time), timed over --launches
launches with --entries other versions in the index, so it shows how it grows with the cache's size.
"""
import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agents.datasets import DatasetCache, Entry, manifest_digest  # noqa: E402
from agents.probe.sim import SimProbe  # noqa: E402
from agents.sandbox.process_driver import ProcessDriver  # noqa: E402
from agents.worker import Agent  # noqa: E402
from tests.httpfiles import FileServer  # noqa: E402

MB = 1024 * 1024


class Portal:
    """The agent API answered in-process: confirm, events, progress."""

    lease_renewed_at = None

    def __init__(self):
        self.started = {}

    def register(self, **body):
        return {"node": 1, "heartbeat_interval_s": 10, "lease_s": 3600}

    def confirm(self, job_id, attempt):
        return {}

    def event(self, job_id, attempt, state, **kw):
        if state == "running":
            self.started[job_id] = time.perf_counter()

    def progress(self, job_id, attempt, stage, message):
        return {"result": "applied"}


def make_file(path: Path, size: int) -> str:
    h = hashlib.sha256()
    block = os.urandom(MB)
    with open(path, "wb") as f:
        for _ in range(size // MB):
            f.write(block)
            h.update(block)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="the dataset's size")
    ap.add_argument("--entries", type=int, default=1000, help="other versions in the index for the bookkeeping run")
    ap.add_argument("--launches", type=int, default=200, help="cache hits timed for the bookkeeping figure")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dataset-bench-"))
    served = work / "served"
    served.mkdir()
    server = FileServer(served)
    try:
        size = args.mb * MB
        digest_file = make_file(served / "set.bin", size)
        files = [{"path": "set.bin", "size": size, "sha256": digest_file}]
        ds = {"name": "bench", "version": 1, "digest": manifest_digest(files), "size": size, "archive": False,
              "files": [{**files[0], "url": f"{server.url}/set.bin"}]}
        cache = DatasetCache(str(work / "cache"), 2 * size + 64 * MB)
        portal = Portal()
        agent = Agent(name="bench", client=portal, driver=ProcessDriver(node="bench", state_dir=str(work / "state")),
                      probe=SimProbe("1xH100-80GB", node_name="bench"), stop_grace_s=0.5, background=False,
                      scrub_gpus=False, datasets=cache)
        spec = {"image": "none", "command": ["sleep", "60"], "cpus": 1, "memory_mb": 256, "time_limit_s": 600,
                "datasets": [ds]}
        rows = []
        for job_id, label in (("1", "uncached"), ("2", "cached")):
            t0 = time.perf_counter()
            assert agent.launch(job_id, 1, spec) == "started"
            rows.append((label, portal.started[job_id] - t0))
        for job_id in ("1", "2"):
            agent.stop(job_id, 1, "bench over", 0.5)
        print(f"dataset of {args.mb} MB over HTTP on loopback, process sandbox:")
        for label, seconds in rows:
            print(f"  start time, {label:8s}: {seconds:8.3f} s")
        print(f"  uncached fetch rate: {args.mb / rows[0][1]:.0f} MB/s (download, sha256, store)")

        # Bookkeeping per launch: a hit (lookup, reference, index write) and its release, with N entries.
        for entries in (1, args.entries):
            book = DatasetCache(str(work / f"book-{entries}"), 10 ** 15)
            for i in range(entries - 1):
                d = hashlib.sha256(str(i).encode()).hexdigest()
                os.makedirs(book.path(d) + "/data")
                book.entries[d] = Entry(1, 0.0)
            os.makedirs(book.path(ds["digest"]) + "/data")
            book.entries[ds["digest"]] = Entry(size, 0.0)
            t0 = time.perf_counter()
            for n in range(args.launches):
                book.acquire(f"{n}:1", [ds])
                book.release(f"{n}:1")
            per = (time.perf_counter() - t0) / args.launches
            print(f"  bookkeeping per launch (hit + release), {entries:5d} entries in the index: {per * 1e6:8.0f} us")
    finally:
        server.stop()
        for folder, _, _ in os.walk(work):
            os.chmod(folder, 0o755)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
