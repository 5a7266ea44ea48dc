"""The invariants of docs/reliability.md, checked over the database and the jobs' own records.

Each job of the suite appends to `truth/<job id>` lines written by its own shell:
`start ATTEMPT T PID`, then `tick ATTEMPT T` every half second, then `end ATTEMPT T`; T is the
host's clock (all processes share one host). An attempt ran at least from its start to its last
tick or end line, which is what the overlap check compares.
"""
from collections import defaultdict
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

TERMINAL = ("succeeded", "failed", "cancelled", "timeout", "node_fail", "oom")
TICK_S = 0.5


def job_command(truth: Path, run_s: float, rerun_s: float | None = None) -> list[str]:
    """`rerun_s`: how long a later attempt runs (default `run_s`). A short rerun proves as much: a
    requeue while the old attempt still runs shows as the old attempt's records past the new start
    (or past the requeue), however long the new attempt is; it only ends the case sooner."""
    ticks = max(1, int(run_s / TICK_S))
    reticks = ticks if rerun_s is None else max(1, int(rerun_s / TICK_S))
    return ["sh", "-c",
            f'f={truth}/$GPUPORTAL_JOB_ID; a=$GPUPORTAL_ATTEMPT; n={ticks}; [ "$a" -gt 1 ] && n={reticks}; '
            f'echo "start $a $(date +%s.%N) $$" >> $f; i=0; '
            f'while [ $i -lt $n ]; do sleep {TICK_S}; echo "tick $a $(date +%s.%N)" >> $f; i=$((i+1)); done; '
            f'echo "end $a $(date +%s.%N)" >> $f']


def ground_truth(truth: Path, job_id: int) -> dict[int, dict]:
    """attempt -> {"start": t, "last": t, "ended": bool, "starts": n}"""
    path = truth / str(job_id)
    attempts: dict[int, dict] = {}
    if not path.exists():
        return attempts
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue  # a line cut by a kill
        kind, attempt, t = parts[0], int(parts[1]), float(parts[2])
        a = attempts.setdefault(attempt, {"start": t, "last": t, "ended": False, "starts": 0})
        a["starts"] += kind == "start"
        a["last"] = max(a["last"], t)
        a["ended"] |= kind == "end"
    return attempts


def check(cluster, accepted: list[int]) -> list[str]:
    """Every broken invariant as one line naming the jobs and the evidence; [] when all hold."""
    problems: list[str] = []
    rows = {r[0]: r for r in cluster.sql(
        "SELECT id, state, attempt, exit_code, reason_message FROM jobs_job WHERE id = ANY(%s)", [accepted])}
    # Nothing accepted is lost.
    lost = sorted(set(accepted) - set(rows))
    if lost:
        problems.append(f"lost: accepted jobs {lost} have no row")
    # Every accepted job ends in exactly one terminal state.
    not_done = {i: r[1] for i, r in rows.items() if r[1] not in TERMINAL}
    if not_done:
        problems.append(f"not terminal: {not_done}")
    ends = defaultdict(list)
    for job_id, state in cluster.sql("SELECT job_id, state FROM jobs_jobevent WHERE terminal AND job_id = ANY(%s)",
                                     [accepted]):
        ends[job_id].append(state)
    for job_id, r in rows.items():
        if r[1] in TERMINAL and ends[job_id] != [r[1]]:
            problems.append(f"job {job_id}: state {r[1]} but terminal events {ends[job_id]}")
    # No job ran as two attempts at once, nor was requeued before its old attempt was dead (a node's
    # jobs go elsewhere only after its lease deadline and the kill margin); the recorded outcome
    # agrees with what the job did.
    requeued = defaultdict(list)
    for job_id, attempt, at in cluster.sql("SELECT job_id, attempt, extract(epoch FROM at) FROM jobs_jobevent "
                                           "WHERE state = 'queued' AND job_id = ANY(%s)", [accepted]):
        requeued[job_id].append((attempt, float(at)))
    for job_id, r in rows.items():
        attempts = ground_truth(cluster.truth, job_id)
        for n, a in attempts.items():
            if a["starts"] > 1:
                problems.append(f"job {job_id}: attempt {n} started {a['starts']} times")
        for n, t in requeued.get(job_id, ()):
            if n in attempts and attempts[n]["last"] > t:
                problems.append(f"job {job_id}: attempt {n} was requeued while it still ran, "
                                f"{attempts[n]['last'] - t:.1f}s before its last record")
        spans = sorted((a["start"], a["last"], n) for n, a in attempts.items())
        for (s1, e1, n1), (s2, e2, n2) in zip(spans, spans[1:]):
            if s2 < e1:
                problems.append(f"job {job_id}: attempts {n1} and {n2} ran at once for {e1 - s2:.1f}s")
        last = attempts.get(r[2])
        if r[1] == "succeeded" and not (last and last["ended"]):
            problems.append(f"job {job_id}: succeeded but attempt {r[2]} never wrote its end")
        if r[1] == "failed" and last and last["ended"]:
            problems.append(f"job {job_id}: recorded failed (exit code {r[3]}) but attempt {r[2]} ran to its end")
        elif r[1] == "failed":
            # The suite's jobs never fail by themselves: a fault that ended one (a fence, a lost exit
            # code) counted the node's fault as the user's. It must be requeued (or end node_fail).
            problems.append(f"job {job_id}: recorded failed (exit code {r[3]}, attempt {r[2]}) though its command "
                            f"cannot fail: {r[4][:120]!r}")
    # No whole GPU held by two allocations at once; no allocation of an ended job left open.
    allocs = cluster.sql("SELECT a.id, a.gpu_id, a.job_id, a.started_at, a.released_at, a.fraction, j.state "
                         "FROM jobs_allocation a JOIN jobs_job j ON j.id = a.job_id WHERE NOT a.shared "
                         "ORDER BY a.gpu_id, a.started_at, a.id")
    for prev, cur in zip(allocs, allocs[1:]):
        if prev[1] == cur[1] and (prev[4] is None or cur[3] < prev[4]):
            problems.append(f"GPU {cur[1]}: allocations {prev[0]} (job {prev[2]}) and {cur[0]} (job {cur[2]}) "
                            f"overlap from {cur[3]:%H:%M:%S.%f} to {prev[4] and f'{prev[4]:%H:%M:%S.%f}'}")
    open_done = [(a[0], a[2]) for a in allocs if a[4] is None and a[6] in TERMINAL]
    if open_done:
        problems.append(f"allocations of ended jobs still open (allocation, job): {open_done}")
    # Billed GPU time equals allocated time within 1 s per allocation (after metering).
    cluster.meter()
    billed = dict(cluster.sql("SELECT allocation_id, sum(gpu_seconds) FROM billing_usagerecord GROUP BY 1"))
    for a in allocs:
        if a[4] is None:
            continue
        held = Decimal((a[4] - a[3]) / timedelta(microseconds=1)) / 1_000_000 * a[5]
        got = billed.get(a[0], Decimal(0))
        if abs(got - held) > 1:
            problems.append(f"allocation {a[0]} (job {a[2]}): billed {got:.3f} GPU-s, allocated {held:.3f}")
    return problems
