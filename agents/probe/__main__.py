"""Print this node's GPUs and a few samples as JSON (used by bench/gpu_check.sh).

    python -m agents.probe [--gpus auto|nvml|sim:8xH100-80GB] [--samples 3] [--interval 1]
"""

import argparse
import json
import logging
import time

from agents.probe import make_probe


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m agents.probe")
    ap.add_argument("--gpus", default="auto")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        probe = make_probe(args.gpus, node_name="probe-cli")
    except Exception as exc:  # NVMLError_LibraryNotFound and friends: say it in one line
        raise SystemExit(f"probe: {args.gpus}: {type(exc).__name__}: {exc}") from None
    samples = []
    for n in range(args.samples):
        if n:
            time.sleep(args.interval)
        samples.append([s.as_dict() for s in probe.sample()])
    print(json.dumps({
        "probe": probe.kind,
        "inventory": [g.as_dict() for g in probe.inventory()],
        "samples": samples,
    }, indent=2))


if __name__ == "__main__":
    main()
