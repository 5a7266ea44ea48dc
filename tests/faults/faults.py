"""The faults, one at a time, and a case: load, fault, recovery, drain, invariants, timings.

A case submits a first long job and takes the node it lands on as the target (so an agent
fault always hits a running job with time left), then the rest of the load, injects the fault
while that load runs, lets it recover, waits until every accepted job is terminal, and runs
the checker. Submissions keep coming during the fault: a 201 is an accepted job and must end.

Time to detect: from the fault to the portal's first reaction (the target node marked down, a
job requeued, or the API answering an error). Time to recover: from the end of the fault (a restart, a
SIGCONT; the fault itself for an agent kept down) until the API answers 200 and every node
with a live agent is ready again.
"""
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import requests

from tests.faults.checker import TERMINAL, check, job_command
from tests.faults.cluster import Cluster, wait_for


@dataclass
class Outcome:
    fault: str
    problems: list[str] = field(default_factory=list)
    detect_s: float | None = None
    recover_s: float | None = None
    drain_s: float = 0.0
    jobs: int = 0

    @property
    def result(self) -> str:
        if not self.problems:
            return "ok"
        return f"{'known gap' if self.fault in KNOWN else 'BROKEN'} ({len(self.problems)})"


class Watch:
    """Polls the API and the target node every 0.2 s from a thread and stamps first reactions."""

    def __init__(self, cluster: Cluster, target: str):
        self.cluster, self.target = cluster, target
        self.first_error = self.first_down = self.first_requeue = None
        self.requeues = self._requeues()
        self.armed = False  # an error seen under load before the fault must not count
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self):
        while not self._stop.wait(0.2):
            if not self.armed:
                continue
            now = time.monotonic()
            if self.first_error is None and not self.cluster.api_ok():
                self.first_error = now
            if self.first_requeue is None and self.requeues is not None and (self._requeues() or 0) > self.requeues:
                self.first_requeue = now
            if self.first_down is None:
                try:
                    if self.cluster.sql("SELECT state FROM nodes_node WHERE name = %s", [self.target], col=0) == ["down"]:
                        self.first_down = now
                except Exception:  # the database may be the fault
                    pass

    def _requeues(self) -> int | None:
        try:
            return self.cluster.sql("SELECT count(*) FROM jobs_jobevent WHERE state = 'queued' "
                                    "AND message LIKE %s", ["%Requeued as attempt%"], col=0)[0]
        except Exception:  # the database may be the fault
            return None

    def arm(self) -> float:
        self.armed = True
        return time.monotonic()

    def stop(self):
        self._stop.set()
        self._th.join(10)


# A requeued job's later attempt runs 2 s: its overlap with the old one shows all the same, and the
# case ends a first job's length sooner (tests/faults/checker.py, job_command).
RERUN_S = 2.0


class Load:
    def __init__(self, cluster: Cluster, seed: int):
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.accepted: list[int] = []
        self.refused: dict[int, int] = {}
        self.last_refusal = ""

    def submit(self, run_s: float | None = None, gpus: int | None = None) -> int | None:
        run_s = run_s or self.rng.uniform(2, 8)
        body = {"project": "vision", "name": "fault", "image": "gpuportal/busybox:latest",
                "command": job_command(self.cluster.truth, run_s, rerun_s=RERUN_S),
                "resources": {"gpus": gpus or self.rng.choice([1, 1, 2, 2, 3, 4]), "cpus": 0.1, "memory_mb": 64},
                "time_limit": max(300, int(2 * run_s))}
        try:
            r = requests.post(f"{self.cluster.url}/api/v1/jobs/", json=body, headers=self.cluster.headers(), timeout=10)
        except requests.RequestException:
            self.refused[0] = self.refused.get(0, 0) + 1
            return None
        if r.status_code == 201:
            self.accepted.append(r.json()["id"])
            return self.accepted[-1]
        assert r.status_code < 500 or r.status_code == 503, f"{r.status_code}: {r.text[:300]}"
        self.refused[r.status_code] = self.refused.get(r.status_code, 0) + 1
        self.last_refusal = f"{r.status_code}: {r.text[:300]}"
        return None


# -- faults: each takes (cluster, target agent) and returns the monotonic time the fault ended --

def agent_sigkill_kept_down(c: Cluster, target: str) -> float:
    c.kill(target)
    return time.monotonic()


def agent_sigstop_past_lease(c: Cluster, target: str) -> float:
    c.signal(target, signal.SIGSTOP)
    time.sleep(float(c.env["NODE_TIMEOUT_S"]) + 6)  # the fault's duration: past the lease and the timeout
    c.signal(target, signal.SIGCONT)
    return time.monotonic()


def agent_sigstop_within_timeout(c: Cluster, target: str) -> float:
    # Frozen past its lease (each job's supervisor fences its job) but back before the node timeout:
    # the returning agent reports the fenced ends, which the portal must requeue, not fail.
    c.signal(target, signal.SIGSTOP)
    time.sleep(float(c.env["AGENT_LEASE_S"]) + 2)  # lease 6 s, grace 1 s, node timeout 10 s
    c.signal(target, signal.SIGCONT)
    return time.monotonic()


def node_partitioned(c: Cluster, target: str) -> float:
    # Every packet between the node and the portal side dropped (iptables in the agent's network
    # namespace), the agent and its jobs running on: the agent and the jobs' supervisors fence at the
    # lease deadline, the portal re-places the jobs only after the node timeout; then it heals.
    c.partition(target, True)
    try:
        time.sleep(float(c.env["NODE_TIMEOUT_S"]) + 6)  # the fault's duration: past the lease and the timeout
    finally:
        c.partition(target, False)
    return time.monotonic()


def agent_restarted_after_8s(c: Cluster, target: str) -> float:
    c.kill(target)
    time.sleep(8)  # the fault's duration
    c.start_agent(target)
    return time.monotonic()


def worker_killed_mid_pass(c: Cluster, target: str) -> float:
    # The worker SIGKILLs itself inside a pass: before its commit (nothing may be half-applied),
    # then between the commit and the launch's publish (the launch must be re-sent).
    load = Load(c, seed=7)
    c.stop("worker")
    for point in ("schedule.before_commit", "schedule.after_commit_before_publish"):
        c.start_worker(crashpoint=point)
        load.submit()  # a submit asks for a pass
        proc = c.procs["worker"][0]
        wait_for(lambda: proc.poll() is not None, 60, f"the worker to die at {point}")
        assert proc.returncode == -signal.SIGKILL, f"the worker exited {proc.returncode}, not at {point}"
        c.procs.pop("worker")[1].close()
    c.extra_accepted = load.accepted
    c.start_worker()
    return time.monotonic()


def redis_restarted(c: Cluster, target: str) -> float:
    c.kill("redis")
    time.sleep(5)  # the fault's duration
    c.start_redis()
    return time.monotonic()


def postgres_restarted(c: Cluster, target: str) -> float:
    c.stop_postgres("immediate")
    time.sleep(8)  # the fault's duration
    c.start_postgres()
    return time.monotonic()


LONG_OUTAGE_S = 300


def postgres_down_5min(c: Cluster, target: str) -> float:
    c.stop_postgres("immediate")
    time.sleep(LONG_OUTAGE_S)
    c.start_postgres()
    return time.monotonic()


def redis_down_5min(c: Cluster, target: str) -> float:
    c.kill("redis")
    time.sleep(LONG_OUTAGE_S)
    c.start_redis()
    return time.monotonic()


def portal_frozen(c: Cluster, target: str) -> float:
    # gunicorn (master and workers) SIGSTOPped past the agents' lease and the node timeout: the kernel still
    # accepts connections, nothing answers them. The agents take it for the portal's outage, not silence
    # (their host probe connects), and the reaper, hearing no node, marks none down (rule 4); then SIGCONT,
    # and the queued requests are answered late.
    c.signal("web", signal.SIGSTOP)
    try:
        time.sleep(float(c.env["NODE_TIMEOUT_S"]) + 6)  # the fault's duration: past the lease and the timeout
    finally:
        c.signal("web", signal.SIGCONT)
    return time.monotonic()


def portal_restarted(c: Cluster, target: str) -> float:
    c.stop_portal(kill=True)
    c.start_portal()
    return time.monotonic()


FAULTS = {
    "agent-sigkill-kept-down": agent_sigkill_kept_down,
    "agent-sigstop-past-lease": agent_sigstop_past_lease,
    "agent-sigstop-within-timeout": agent_sigstop_within_timeout,
    "node-partitioned": node_partitioned,
    "agent-restarted-after-8s": agent_restarted_after_8s,
    "worker-killed-mid-pass": worker_killed_mid_pass,
    "redis-restarted": redis_restarted,
    "postgres-restarted": postgres_restarted,
    "portal-restarted": portal_restarted,
    "portal-frozen": portal_frozen,
    "postgres-down-5min": postgres_down_5min,
    "redis-down-5min": redis_down_5min,
}
# Long faults: only in the full suite, and their first job outlasts the outage; every job running when
# the fault began must run on to its own end as the same attempt (the portal's outage is no node's).
LONG = {"postgres-down-5min", "redis-down-5min"}
FIRST_RUN_S = {f: LONG_OUTAGE_S + 40 for f in LONG}
# The portal's short restarts last 8-11 s: a 15 s job still runs past the agents' 6 s lease (and its fence).
FIRST_RUN_S |= {"postgres-restarted": 15, "portal-restarted": 15}
FIRST_RUN_S["portal-frozen"] = 22  # runs through the 16 s freeze
SUBMIT_EVERY_S = {f: 15.0 for f in LONG}  # fewer submissions during a long outage: the backlog must drain
SURVIVE = LONG | {"postgres-restarted", "redis-restarted", "portal-restarted", "portal-frozen"}
AGENT_KEPT_DOWN = {"agent-sigkill-kept-down"}
# Faults that still break an invariant, and why: the table says "known gap", the pytest case is
# xfail(strict=True). Remove an entry when its fix lands.
KNOWN: dict[str, str] = {}


def run_case(c: Cluster, fault: str, jobs: int = 10, seed: int = 1, drain_timeout: float = 150,
             submit_every_s: float = 1.0) -> Outcome:
    """`submit_every_s`: how often a job is submitted during the fault (outside the 5-minute outages)."""
    out = Outcome(fault)
    load = Load(c, seed)
    c.extra_accepted = []
    first = load.submit(run_s=FIRST_RUN_S.get(fault, 25), gpus=1)
    assert first is not None, f"the first job was refused: {load.last_refusal}"
    target = wait_for(lambda: (r := c.sql("SELECT j.state, n.name FROM jobs_job j JOIN nodes_node n ON n.id = j.node_id "
                                          "WHERE j.id = %s", [first])) and r[0][0] == "running" and r[0][1], 60,
                      f"job {first} to run; worker log:\n{c.log('worker')[-3000:]}")
    for _ in range(jobs - 1):
        load.submit()
    wait_for(lambda: c.sql("SELECT count(*) FROM jobs_job WHERE id = ANY(%s) AND state = 'running'",
                           [load.accepted], col=0)[0] >= 2, 60, "the load to run")
    stop_submitting = threading.Event()

    def keep_submitting():  # accepted during the fault: must end too
        while not stop_submitting.wait(SUBMIT_EVERY_S.get(fault, submit_every_s)):
            load.submit()

    submitter = threading.Thread(target=keep_submitting, daemon=True)
    watch = Watch(c, target)
    running = dict(c.sql("SELECT id, attempt FROM jobs_job WHERE id = ANY(%s) AND state = 'running'",
                         [load.accepted]))
    log_marks = {n: len(c.log(n)) for n in c.nodes}  # what each agent logged before the fault
    submitter.start()
    try:
        t0 = watch.arm()
        ended = FAULTS[fault](c, target)
        alive = [n for n in c.nodes if n != target or fault not in AGENT_KEPT_DOWN]
        wait_for(c.api_ok, 90, "the API to answer again")
        for key, start in (("worker", c.start_worker), ("beat", c.start_beat)):
            # A portal process that exited by itself is a finding; started again to go on, as systemd's
            # Restart=on-failure does (deploy/systemd), so one case's crash does not break the next.
            if key in c.procs and c.procs[key][0].poll() is not None:
                tail = [ln for ln in c.log(key).splitlines() if "Error" in ln or "CRITICAL" in ln][-2:]
                out.problems.append(f"the portal's {key} exited during the fault: {' | '.join(tail)[:400]}")
                c.procs.pop(key)[1].close()
                start()
        for name in alive:  # an agent that exited by itself is a finding; it is started again to go on
            if not c.agent_alive(name):
                tail = [ln for ln in c.log(name).splitlines() if "CRITICAL" in ln or "ERROR" in ln][-2:]
                out.problems.append(f"agent {name} exited during the fault: {' | '.join(tail)[:400]}")
                c.procs.pop(name)[1].close()
                c.start_agent(name)
        c.wait_nodes_ready(alive, timeout=90)
        out.recover_s = time.monotonic() - ended
        stop_submitting.set()
        submitter.join(15)
        accepted = load.accepted + c.extra_accepted
        out.jobs = len(accepted)

        def all_terminal():
            states = c.sql("SELECT state FROM jobs_job WHERE id = ANY(%s)", [accepted], col=0)
            return len(states) == len(accepted) and all(s in TERMINAL for s in states)

        try:
            wait_for(all_terminal, drain_timeout, "every accepted job to end")
        except AssertionError:
            pass  # the checker names the jobs that did not end
        out.drain_s = time.monotonic() - t0
        firsts = [t for t in (watch.first_down, watch.first_error, watch.first_requeue) if t is not None]
        out.detect_s = min(firsts) - t0 if firsts else None
    finally:
        stop_submitting.set()
        watch.stop()
    out.problems += check(c, accepted)
    if fault in SURVIVE:  # the portal's own outage: what ran goes on, as the same attempt, to its own end
        for name, mark in log_marks.items():  # and no agent took it for silence (a fence of an idle node shows here only)
            fences = [ln for ln in c.log(name)[mark:].splitlines() if "LEASE EXPIRED" in ln]
            if fences:
                out.problems.append(f"agent {name} fenced during the portal's own outage: {fences[0][:300]}")
        for job_id, state, attempt in c.sql("SELECT id, state, attempt FROM jobs_job WHERE id = ANY(%s)",
                                            [list(running)]):
            if (state, attempt) != ("succeeded", running[job_id]):
                out.problems.append(f"job {job_id}, running at the fault as attempt {running[job_id]}, did not run "
                                    f"on: {state} at attempt {attempt}")
    if fault in AGENT_KEPT_DOWN:  # back for the next case
        c.start_agent(target)
        c.wait_nodes_ready(c.nodes, timeout=90)
    return out


def table(outcomes: list[Outcome]) -> str:
    lines = [f"{'fault':28} {'result':15} {'detect':>8} {'recover':>8} {'drain':>7} {'jobs':>5}"]
    for o in outcomes:
        det = f"{o.detect_s:.1f}s" if o.detect_s is not None else "-"
        rec = f"{o.recover_s:.1f}s" if o.recover_s is not None else "-"
        lines.append(f"{o.fault:28} {o.result:15} {det:>8} {rec:>8} {o.drain_s:6.1f}s {o.jobs:5d}")
    for o in outcomes:
        for p in o.problems:
            lines.append(f"  {o.fault}: {p}")
    return "\n".join(lines)
