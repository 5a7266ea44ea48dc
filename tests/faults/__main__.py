"""The fault suite as one command: `python -m tests.faults --full` (every fault, the 5-minute outages
included, more jobs) or
`python -m tests.faults FAULT...`. Prints the table: fault, result, time to detect, time to
recover, time until every job ended. Runs against a cluster of its own (tests/faults/cluster.py);
needs PostgreSQL's server binaries and redis-server installed, nothing running."""
import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from tests.faults.cluster import Cluster
from tests.faults.faults import FAULTS, LONG, run_case, table


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    parser.add_argument("faults", nargs="*", metavar="FAULT", help=f"faults to run (default: all): {', '.join(FAULTS)}")
    parser.add_argument("--full", action="store_true",
                        help=f"every fault with the full load, the long ones ({', '.join(sorted(LONG))}) included")
    parser.add_argument("--jobs", type=int, default=None, help="jobs submitted before each fault")
    parser.add_argument("--keep", action="store_true", help="keep the cluster's folder (logs, ground truth)")
    args = parser.parse_args()
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    faults = args.faults or [f for f in FAULTS if args.full or f not in LONG]
    jobs = args.jobs or (24 if args.full else 10)
    tmp = Path(tempfile.mkdtemp(prefix="gpuportal-faults-"))
    cluster = Cluster(tmp)
    outcomes = []
    try:
        cluster.start_all()
        for i, fault in enumerate(faults):
            outcomes.append(run_case(cluster, fault, jobs=jobs, seed=i + 1))
            print(table(outcomes[-1:]).splitlines()[1], flush=True)
    finally:
        cluster.close()
        print(f"\n{table(outcomes)}")
        if args.keep:
            print(f"logs and ground truth: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(not o.problems for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
