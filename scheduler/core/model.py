"""Plain dataclasses the scheduler core takes and returns.

The Django adapter (scheduler/tasks.py) and the trace simulator (scheduler/sim)
both build a `Snapshot` and read back a `Plan`; nothing here imports Django.
Times are seconds (epoch or virtual clock, the core does not care which),
GPU counts are floats so a fraction of a shared GPU can be expressed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agents import protocol
from agents.protocol import DEFAULT_SANDBOX

# Reason codes, defined once so the adapter, CLI and tests grep the same names.
REASON_QUOTA_PROJECT = "quota_project"  # project max GPUs reached
REASON_QUOTA_ORG = "quota_org"  # organization max GPUs reached
REASON_MAX_RUNNING = "max_running"  # project's max running jobs reached
REASON_TIME_LIMIT = "time_limit"  # job's time limit above the project's maximum
REASON_BUDGET = "budget"  # project's GPU-hour budget is spent
REASON_GPU_TYPE = "gpu_type"  # type not allowed for the project or absent from the cluster
REASON_DEPENDENCY = "dependency"  # a job it depends on has not finished
REASON_ARRAY_THROTTLE = "array_throttle"  # array's %N limit reached
REASON_RESOURCES = "resources"  # not enough free GPUs of the kind asked for
REASON_RESERVATION = "reservation"  # free GPUs are held for a higher-priority job
REASON_PRIORITY = "priority"  # higher-priority jobs go first (backfill off, or not examined)
REASON_PREEMPTING = "preempting"  # running work is being preempted to make room
REASON_UNPLACEABLE = "unplaceable"  # larger than every matching GPU in the cluster together
REASON_SANDBOX = "sandbox"  # no schedulable node offers the sandbox the job asks for
# Enough matching GPUs are free, but not on one node (or not on `nodes` nodes with gpus_per_node each):
# it would start only if split, which a job is never unless it asks for several nodes.
REASON_FRAGMENTED = "fragmented"
# No schedulable node has the CPUs or memory the job asks for (per node) free now, or at all, beside
# the GPUs it would take there.
REASON_NODE_RESOURCES = "node_resources"
# It could start now, but only on nodes without its datasets, while a node that holds them all is
# busy: it waits for that node, at most Config.locality_wait_s after it entered the queue.
REASON_LOCALITY = "locality"

# A node's sandbox before its agent first registers: it counts as one running the default sandbox.
UNREGISTERED_SANDBOX = ""


def sandbox_hosts(sandbox: str) -> tuple[str, ...]:
    """The node sandboxes that run a job's sandbox: the agent contract's table (agents/protocol.py)."""
    hosts = protocol.sandbox_hosts(sandbox)
    return (UNREGISTERED_SANDBOX, *hosts) if DEFAULT_SANDBOX in hosts else hosts


@dataclass
class GPU:
    """One physical GPU. `shared` GPUs accept fractional jobs; `load` is a 0..1
    utilization/heat hint the spread placement uses to break ties."""

    id: str
    node: str
    index: int
    model: str
    memory_mb: int
    healthy: bool = True
    shared: bool = False
    load: float = 0.0
    sandbox: str = ""  # its node's
    # Interconnect domains the probe reported: (NVLink/NVSwitch group, PCIe switch, NUMA node), each
    # an id within its node or None when not known; None: no topology at all (see placement.TOPO_LEVELS).
    topo: tuple | None = None


@dataclass(frozen=True)
class Dataset:
    """A dataset a job reads: its content digest (what node caches hold), its size in bytes and
    the name its reasons show ("imagenet-1k@3"; the digest's head when empty)."""

    digest: str
    size: int = 0
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.digest[:12]


@dataclass
class Node:
    """`cpus` and `memory_mb` are what its agent registered (0: not known yet, not accounted); every
    job on it (GPU or CPU-only) counts against them, less Config's system reserve. `sandbox` is its
    agent's, for CPU-only jobs (a GPU carries its node's too)."""

    name: str
    pool: str
    gpus: list[GPU]
    schedulable: bool = True  # False while draining/drained/down
    cpus: float = 0.0
    memory_mb: int = 0
    sandbox: str = ""
    # Digests of the datasets its agent's cache holds (complete and verified): placement prefers
    # nodes holding a job's datasets (docs/scheduler.md, "Dataset locality").
    datasets: frozenset[str] | set[str] = frozenset()


@dataclass
class Job:
    """A queued (or, inside an Allocation, running) job.

    `gpus` is a whole number (0 = CPU-only) or a fraction 0 < g < 1 that must go
    on a shared GPU. A job's GPUs are on one node unless it asks for `nodes` > 1;
    then it gets exactly `gpus / nodes` GPUs on each of `nodes` distinct nodes
    (one gang; the caller guarantees the division is exact).
    """

    id: str
    project: str
    org: str
    user: str
    gpus: float
    submit_time: float
    time_limit: float
    gpu_type: str | None = None
    gpu_memory_mb: int = 0
    qos: int = 0
    preemptible: bool = False
    array_parent: str | None = None
    array_limit: int | None = None
    deps_satisfied: bool = True
    pool: str | None = None
    sandbox: str = "docker"
    nodes: int = 1
    # GPU-seconds of service its earlier attempts got (GPUs x time run; a running job's current
    # attempt is added by the core from its allocation), and when it last entered the queue
    # (None: at submit). The `las` policy orders and preempts by them.
    attained_gpu_s: float = 0.0
    queued_since: float | None = None
    # What its sandbox gets on each of its nodes (0: nothing accounted, as in traces without them).
    cpus: float = 0.0
    memory_mb: int = 0
    # The job checkpoints: on preemption it gets its signal and this many seconds to save, and its
    # next attempt resumes from the checkpoint (docs/jobs.md). None: it does not, so preempting it
    # throws away everything its attempt did; such jobs are victims only as a last resort.
    checkpoint_grace_s: float | None = None
    # A checkpointing job that saves on its own every this many seconds of its run, and keeps only
    # what it saved then: preempted, it loses the time since its last save plus its grace. None:
    # it saves when signalled (docs/jobs.md), so it loses only its grace.
    checkpoint_interval_s: float | None = None
    # The datasets it reads: placement prefers nodes whose cache holds them (the more bytes the
    # better) and may wait a little for one (Config.locality_wait_s). Empty: placement as without.
    datasets: tuple[Dataset, ...] = ()
    # Nodes it must not be placed on now: they reported it not startable there a moment ago (their
    # dataset cache full of what running jobs read), so it goes elsewhere or waits.
    avoid_nodes: frozenset[str] = frozenset()

    @property
    def checkpoints(self) -> bool:
        return self.checkpoint_grace_s is not None

    @property
    def gpus_per_node(self) -> int:
        return int(self.gpus) // max(self.nodes, 1)


@dataclass
class Allocation:
    """A running job and the GPUs it holds. `fractions` maps gpu_id -> fraction
    for a job on a shared GPU; a whole-GPU job leaves it empty."""

    job: Job
    gpu_ids: list[str]
    start_time: float
    fractions: dict[str, float] = field(default_factory=dict)
    borrowed: bool = False
    node: str | None = None  # a CPU-only job's node (a GPU job's come from its GPUs)


@dataclass
class ProjectQuota:
    """Guaranteed GPUs are the project's own; usage above them (up to max_gpus)
    is borrowed from idle capacity and may be preempted. `share` is the
    fair-share weight (defaults to guaranteed_gpus); a budget of None is
    unlimited; an empty allowed_gpu_types allows any type."""

    project: str
    org: str
    guaranteed_gpus: float
    max_gpus: float
    max_running_jobs: int | None = None
    max_time_limit: float | None = None
    gpu_hours_budget: float | None = None
    gpu_hours_used: float = 0.0
    allowed_gpu_types: tuple[str, ...] = ()
    share: float | None = None

    @property
    def weight(self) -> float:
        return self.guaranteed_gpus if self.share is None else self.share


@dataclass
class OrgQuota:
    org: str
    max_gpus: float | None  # None: no org-wide cap


@dataclass
class Config:
    """Knobs of one pass. Per-pool overrides win over the cluster-wide value."""

    # fifo: strict head-of-line in submit order (the first job that is admitted but cannot
    # start blocks every later one); fifo-backfill: first fit in submit order (every job that
    # fits starts, no reservation); multifactor: Slurm-like priority with EASY backfill;
    # las: Tiresias' two-dimensional least attained service (see ordering.py).
    policy: str = "multifactor"
    # Guaranteed quotas take part in the pass: a start above the guarantee is borrowed,
    # multifactor considers jobs within their guarantee before borrowing ones, and a job
    # within its guarantee may preempt borrowed work. False: none of that (nothing is
    # borrowed); a quota's hard limits (max GPUs, max running jobs, ...) hold either way.
    quotas: bool = True
    placement: str = "bestfit"  # bestfit | spread
    pool_placement: dict[str, str] = field(default_factory=dict)
    pool_policy: dict[str, str] = field(default_factory=dict)
    backfill: bool = True
    preemption: bool = True
    min_runtime_s: float = 600.0
    fairshare_half_life_s: float = 7 * 86400.0
    # Multifactor weights; each factor is normalized to 0..1 first (Slurm style).
    weight_qos: float = 10000.0
    weight_fairshare: float = 5000.0
    weight_age: float = 1000.0
    weight_size: float = 2000.0
    max_age_s: float = 7 * 86400.0  # age factor saturates here (Slurm PriorityMaxAge)
    # Size factor favours small jobs (GPUs x time limit): short small jobs
    # finishing first is what lowers mean JCT; fair share keeps big users honest.
    size_scale_gpu_s: float = 8 * 3600.0  # GPU-seconds at which the size factor is 0.5
    max_reservations: int = 1  # EASY backfill: one reservation for the head job
    # las (Tiresias' discretized two-dimensional LAS): a job's queue is how many of these
    # attained GPU-service thresholds (GPU-seconds, ascending) it has passed; lower queues go
    # first, within a queue by fair share then submit time (`las_fair_share`), and a queued job may
    # preempt running work of a higher queue.
    # A job waiting longer than las_starvation_factor x the time it has run (attained / GPUs)
    # is promoted to the first queue, so long jobs are not starved.
    las_thresholds_gpu_s: tuple[float, ...] = (3600.0,)
    las_starvation_factor: float = 8.0
    # Our departure from Tiresias, which assumes checkpoints: a job that does not checkpoint
    # restarts from zero, so the las rule preempts it only while its current attempt has run at
    # most this many GPU-seconds (None: no bound). Past it, restarting the job loses more than the
    # waiting job gains (measured in docs/scheduler.md). A checkpointing job loses only its grace
    # and is not bounded.
    las_max_loss_gpu_s: float | None = 32 * 3600.0
    # A checkpointing job that saves every `checkpoint_interval_s` is a victim of the las rule only
    # this many seconds after one of its saves: preempted then, it loses little more than its grace.
    # The job that would preempt it waits for the next save (the plan's `next_pass_at` says when).
    las_checkpoint_window_s: float = 120.0
    # Within a las queue, the project furthest below its fair share first (Slurm's fair-share factor
    # from decayed usage, as multifactor's), then submit order. False: submit order, as in Tiresias.
    las_fair_share: bool = True
    max_preempt_attempts: int = 64  # per pass; bounds the cost of a long guaranteed queue
    # Search depth, like Slurm's bf_max_job_test: after this many admitted jobs
    # failed to place, later jobs are only admission-checked and explained.
    # Keeps a pass cheap on a full cluster with a long queue.
    max_failed_placements: int = 200
    explain: bool = True  # False (simulator): skip per-job reasons to save time
    # Kept from every node's registered CPUs and memory for its system (the agent, the engine,
    # the kernel): jobs get the rest.
    node_reserved_cpus: float = 0.0
    node_reserved_memory_mb: int = 0
    # Dataset locality: a job naming datasets that could start now only on nodes lacking some of
    # them, while a node holding them all (and large enough) is busy, waits for such a node until
    # this many seconds after it entered the queue, then takes any node. 0: the bonus only (nodes
    # holding more of its bytes are preferred among those free now), never a wait.
    locality_wait_s: float = 60.0
    # A reservation starting within this many seconds (at the latest) asks its nodes to prefetch
    # the datasets of its job they lack (Plan.prefetch). 0: never. Off by default: on the Philly
    # week most prefetched bytes were never read there, since a reservation often moves or its job
    # starts elsewhere first (docs/scheduler.md, "Dataset locality").
    prefetch_horizon_s: float = 0.0


@dataclass
class Snapshot:
    now: float
    nodes: list[Node]
    running: list[Allocation]
    queued: list[Job]
    projects: dict[str, ProjectQuota]
    orgs: dict[str, OrgQuota]
    usage: dict[str, float]  # decayed GPU-seconds per project, decayed by the caller
    config: Config = field(default_factory=Config)


@dataclass
class Start:
    job_id: str
    gpu_ids: list[str]
    fractions: dict[str, float]
    borrowed: bool
    node: str | None = None  # where a CPU-only job runs (a GPU job runs where its GPUs are)


@dataclass
class Preemption:
    job_id: str
    reason: str
    by_job_id: str


@dataclass
class Reservation:
    job_id: str
    start_time: float
    gpu_ids: list[str]


@dataclass
class Reason:
    code: str
    message: str
    position: int  # 1-based place among the jobs still waiting, in priority order


@dataclass
class Plan:
    starts: list[Start] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    waiting: dict[str, Reason] = field(default_factory=dict)
    # Jobs that failed to place although enough matching GPUs were free (spread over too many
    # nodes): job id -> the free GPUs of its best class. Filled with explain off too (the simulator).
    fragmented: dict[str, int] = field(default_factory=dict)
    # The earliest instant at which a job the las rule could not preempt for now may find a victim
    # (a running job reaching its next checkpoint), or None. Production's periodic pass needs no
    # hint; the simulator runs a pass then.
    next_pass_at: float | None = None
    # Dataset locality. Jobs waiting for a node holding their datasets: job id -> the time their
    # wait ends (the simulator runs a pass then). Prefetch: node -> datasets it lacks of the jobs
    # the plan reserved GPUs on it for, to fetch while they wait (the adapter sends them on).
    locality_waits: dict[str, float] = field(default_factory=dict)
    prefetch: dict[str, list[Dataset]] = field(default_factory=dict)
