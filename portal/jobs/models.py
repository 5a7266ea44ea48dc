from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.tenancy.models import TenantQuerySet


class JobState(models.TextChoices):
    """A job's lifecycle (Slurm's code in brackets). Groups below are the only lists of states."""

    QUEUED = "queued", "Queued"  # [PD] waiting for admission and GPUs; `reason` says why
    ASSIGNED = "assigned", "Assigned"  # [CF] GPUs allocated, launch sent to the node's agent
    STARTING = "starting", "Starting"  # agent confirmed the attempt and is creating the sandbox
    RUNNING = "running", "Running"  # [R] the command runs in its sandbox
    PREEMPTED = "preempted", "Preempted"  # [PR] stopped for higher-priority work; goes back to queued
    SUCCEEDED = "succeeded", "Succeeded"  # [CD] exit code 0
    FAILED = "failed", "Failed"  # [F] non-zero exit code or a sandbox error
    CANCELLED = "cancelled", "Cancelled"  # [CA] by a user, or a dependency failed
    TIMEOUT = "timeout", "Timed out"  # [TO] ran past its time limit
    NODE_FAIL = "node_fail", "Node failed"  # [NF] its node went silent and requeue was not allowed
    OOM = "oom", "Out of memory"  # [OOM] killed by the memory limit


ACTIVE = frozenset({JobState.QUEUED, JobState.ASSIGNED, JobState.STARTING, JobState.RUNNING, JobState.PREEMPTED})
TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT,
                      JobState.NODE_FAIL, JobState.OOM})
CANCELLABLE = frozenset({JobState.QUEUED, JobState.ASSIGNED, JobState.STARTING, JobState.RUNNING})
# States in which a job holds GPUs (an open Allocation).
HOLDING = frozenset({JobState.ASSIGNED, JobState.STARTING, JobState.RUNNING})

SLURM_CODES = {
    "queued": "PD", "assigned": "CF", "starting": "CF", "running": "R", "preempted": "PR", "succeeded": "CD",
    "failed": "F", "cancelled": "CA", "timeout": "TO", "node_fail": "NF", "oom": "OOM",
}


class Priority(models.TextChoices):
    """QoS classes: the scheduler's qos factor and what preemption compares."""

    LOW = "low", "Low"
    NORMAL = "normal", "Normal"
    HIGH = "high", "High"


QOS_VALUE = {Priority.LOW: 0, Priority.NORMAL: 1, Priority.HIGH: 2}


class JobQuerySet(TenantQuerySet):
    project_path = "project"


class Job(models.Model):
    """One submitted job, or the parent of an array (whose tasks are Jobs with array_parent set)."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.PROTECT, related_name="jobs")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=200)
    # The spec (docs/design.md section 4)
    image = models.CharField(max_length=255)
    command = models.JSONField(default=list)
    env = models.JSONField(default=dict, blank=True)
    # The project's volumes mounted at /data/<name>: [{"name": "data", "read_only": false}] (portal.storage).
    volumes = models.JSONField(default=list, blank=True)
    # The datasets it reads at /datasets/<name>, resolved at submit (portal.storage.datasets):
    # [{"name": "imagenet", "version": 3, "digest": "<sha256 hex>", "size": <bytes>, "source": "s3://..."}].
    datasets = models.JSONField(default=list, blank=True)
    # Nodes that could not start it for want of room they may have later (their dataset cache full of
    # what running jobs read): {node name: epoch seconds}; the scheduler places it elsewhere until then.
    avoid_nodes = models.JSONField(default=dict, blank=True)
    gpus = models.DecimalField(max_digits=6, decimal_places=3, default=0)
    # All of a job's GPUs are on one node unless it asks for more: then `gpus / nodes` on each
    # of exactly `nodes` nodes, started as one gang with the rendezvous variables set.
    nodes = models.PositiveSmallIntegerField(default=1)
    gpu_type = models.CharField(max_length=64, blank=True)
    gpu_memory_mb = models.PositiveIntegerField(default=0)
    cpus = models.DecimalField(max_digits=6, decimal_places=2, default=1)
    memory_mb = models.PositiveIntegerField(default=4096)
    time_limit_s = models.PositiveIntegerField()
    priority = models.CharField(max_length=8, choices=Priority.choices, default=Priority.NORMAL)
    preemptible = models.BooleanField(default=False)
    # Never moved to consolidate nodes (the autoscaler's scale-down, docs/autoscaling.md), checkpoint or not.
    do_not_disrupt = models.BooleanField(default=False)
    sandbox = models.CharField(max_length=8, default="docker")
    network = models.BooleanField(default=False)
    # Checkpointing (docs/jobs.md): when it is preempted, migrated, its node drained or its GPU
    # faulty, the job gets `checkpoint_signal` and `checkpoint_grace_s` seconds to save to
    # GPUPORTAL_CHECKPOINT_DIR before it is stopped; its next attempt resumes from there.
    # "" : it does not checkpoint (a preemption restarts it from zero).
    checkpoint_signal = models.CharField(max_length=8, blank=True)
    checkpoint_grace_s = models.PositiveIntegerField(null=True, blank=True)
    # The spec's `checkpoint.interval_s`: it also saves on its own every this many seconds of its run
    # (told so in GPUPORTAL_CHECKPOINT_INTERVAL_S), so a stop it gets no signal for loses at most
    # that much. None: it saves only when signalled.
    checkpoint_interval_s = models.PositiveIntegerField(null=True, blank=True)
    # Requeued while its last attempt saves its checkpoint: not scheduled before this time, or
    # before that attempt's end is reported, whichever comes first (so two attempts never share
    # the checkpoint folder).
    resume_after = models.DateTimeField(null=True, blank=True)
    # Arrays: the parent keeps the spec and `array`; each task has array_parent and array_index.
    array = models.CharField(max_length=32, blank=True)
    is_array_parent = models.BooleanField(default=False)
    array_parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="tasks")
    array_index = models.PositiveIntegerField(null=True, blank=True)
    array_limit = models.PositiveIntegerField(null=True, blank=True)
    depends_on = models.ManyToManyField("self", symmetrical=False, blank=True, related_name="dependents")
    template = models.ForeignKey("jobs.JobTemplate", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    resubmit_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="resubmits")
    idempotency_key = models.CharField(max_length=128, blank=True)
    # sha256 of the canonical request the key was first used with (services._idempotency_fingerprint):
    # a reuse with anything else is refused, not answered with this job.
    idempotency_fingerprint = models.CharField(max_length=64, blank=True)
    # State
    state = models.CharField(max_length=10, choices=JobState.choices, default=JobState.QUEUED, db_index=True)
    attempt = models.PositiveIntegerField(default=1)
    # Held by a user or admin (Slurm's `scontrol hold`): stays `queued` with reason `held` and is
    # never scheduled until released. A flag, not a state: the lifecycle above stays one list.
    held = models.BooleanField(default=False)
    reason_code = models.CharField(max_length=32, blank=True)
    reason_message = models.CharField(max_length=300, blank=True)
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    # How closely its latest placement's GPUs are linked (scheduler.core.placement.TOPO_LEVELS: nvlink,
    # pcie, numa, system; the worst of a gang's nodes); "" for one GPU, or GPUs without a reported topology.
    placement_topology = models.CharField(max_length=8, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    submitted_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    # Set by the idle detector (metrics.services.jobs_flag_idle) while every GPU of the running job has stayed
    # under GPU_IDLE_UTIL_PCT for GPU_IDLE_MINUTES; cleared when the GPUs work again.
    idle_since = models.DateTimeField(null=True, blank=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [models.Index(fields=["project", "state"]), models.Index(fields=["state", "submitted_at"])]
        constraints = [
            models.UniqueConstraint(fields=["user", "idempotency_key"], condition=~models.Q(idempotency_key=""),
                                    name="job_unique_idempotency_key"),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name}"

    @property
    def placement_topology_label(self) -> str:
        return {"nvlink": "one NVLink group", "pcie": "one PCIe switch", "numa": "one NUMA node",
                "system": "across NUMA nodes"}.get(self.placement_topology, "")

    @property
    def checkpoint(self) -> dict | None:
        """The spec's `checkpoint` ({signal, grace_s[, interval_s]}), or None for a job that does not
        checkpoint; `interval_s` only where the job gave one, as it was submitted."""
        if not self.checkpoint_signal:
            return None
        every = {"interval_s": self.checkpoint_interval_s} if self.checkpoint_interval_s else {}
        return {"signal": self.checkpoint_signal, "grace_s": self.checkpoint_grace_s, **every}

    @property
    def gpus_per_node(self):
        return self.gpus / self.nodes if self.nodes > 1 else self.gpus

    @property
    def slurm_code(self) -> str:
        return SLURM_CODES.get(self.state, "")

    @property
    def slurm_id(self) -> str:
        """How Slurm names it: an array task as <array job>_<index> ("3_0"), any other job by its id."""
        if self.array_parent_id is not None:
            return f"{self.array_parent_id}_{self.array_index}"
        return str(self.pk)

    @property
    def ended_unsuccessfully(self) -> bool:
        """Ended other than succeeded: lists show its exit code and reason."""
        return self.state in TERMINAL and self.state != JobState.SUCCEEDED

    @property
    def elapsed_s(self) -> int | None:
        """Seconds from its first start to its end (or now while it runs); None if it never started."""
        if self.started_at is None:
            return None
        return max(int(((self.ended_at or timezone.now()) - self.started_at).total_seconds()), 0)

    @property
    def warnings(self) -> list[str]:
        """What the job's node could not enforce, for the API and the job page."""
        out = []
        if 0 < self.gpus < 1 and self.node is not None and not self.node.capabilities.get("mps"):
            out.append(f"Node {self.node.name} cannot enforce this job's GPU share (no CUDA MPS): its "
                       f"{self.gpus.normalize()} of a GPU is a scheduling limit only; memory and compute are not capped.")
        if self.gpus > 0 and self.node is not None and self.node.capabilities.get("simulated_gpus"):
            out.append(f"Node {self.node.name} has simulated GPUs: its jobs run without the NVIDIA runtime; this one sees "
                       f"the GPU environment (CUDA_VISIBLE_DEVICES and the rest) but no GPU device.")
        return out


class JobEvent(models.Model):
    """The timeline: one row per transition. At most one terminal row per job (exactly-once end)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    attempt = models.PositiveIntegerField()
    state = models.CharField(max_length=10, choices=JobState.choices)
    terminal = models.BooleanField(default=False)
    message = models.CharField(max_length=300, blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["at", "id"]
        constraints = [models.UniqueConstraint(fields=["job"], condition=models.Q(terminal=True),
                                               name="jobevent_one_terminal_per_job")]


class NotificationSent(models.Model):
    """One email sent about a job: the unique key makes a retried or doubled task mail once."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+")
    attempt = models.PositiveIntegerField()
    kind = models.CharField(max_length=16)  # succeeded, failed, preempted, idle
    sent_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "attempt", "kind"], name="notificationsent_unique")]


class Allocation(models.Model):
    """GPUs held by one attempt of a job, from assignment to release (billing meters these)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="allocations")
    attempt = models.PositiveIntegerField()
    gpu = models.ForeignKey("nodes.GPU", on_delete=models.PROTECT, related_name="allocations")
    fraction = models.DecimalField(max_digits=4, decimal_places=3, default=1)
    shared = models.BooleanField(default=False)
    borrowed = models.BooleanField(default=False)
    started_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    # Its GPU-seconds are in the usage totals (ProjectMonthUsage, ProjectFairshare): set once, by
    # portal.jobs.usage.usage_fold, in the transaction that adds them. Until then readers count it
    # from the row itself, so the totals are exact whenever the fold runs.
    tallied = models.BooleanField(default=False)

    class Meta:
        constraints = [
            # A whole GPU never holds two open allocations; the database refuses it.
            models.UniqueConstraint(fields=["gpu"], condition=models.Q(released_at__isnull=True, shared=False),
                                    name="allocation_one_open_per_whole_gpu"),
        ]
        indexes = [models.Index(fields=["released_at"]),
                   # The few rows read live: open ones and those released since the last fold.
                   models.Index(fields=["job"], condition=models.Q(tallied=False), name="allocation_untallied")]


class ProjectMonthUsage(models.Model):
    """GPU-seconds of a project's tallied allocations that fall in one UTC month (an allocation
    across a month's end counts in both): what budgets read instead of the month's allocations."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="+")
    month = models.DateField()  # its first day
    gpu_s = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "month"], name="projectmonthusage_unique")]


class ProjectFairshare(models.Model):
    """A project's tallied GPU-seconds, each weighted by 0.5 ** (age of its end / half_life_s), as
    of `as_of`: the fair-share usage at any later time is decayed_gpu_s * 0.5 ** (elapsed / half-life)."""

    project = models.OneToOneField("tenancy.Project", on_delete=models.CASCADE, primary_key=True, related_name="+")
    half_life_s = models.FloatField()
    decayed_gpu_s = models.FloatField(default=0.0)
    as_of = models.DateTimeField()


class JobLogChunk(models.Model):
    """Raw log bytes shipped by the agent, keyed by byte offset so a retried chunk is a no-op.

    Bytes, not text: a job may print anything (NUL, invalid UTF-8), and PostgreSQL text holds
    no NUL. Readers decode (selectors.log_read). Chunks of one attempt never overlap; the
    attempt's log ends at the last chunk's end and is at most JOB_LOG_MAX_BYTES long.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_chunks")
    attempt = models.PositiveIntegerField()
    offset = models.BigIntegerField()
    data = models.BinaryField()
    # The notice the portal wrote at the cap; nothing is stored after it.
    marker = models.BooleanField(default=False)

    class Meta:
        ordering = ["attempt", "offset"]
        constraints = [models.UniqueConstraint(fields=["job", "attempt", "offset"], name="joblog_unique_offset")]


class JobTemplateQuerySet(TenantQuerySet):
    project_path = "project"


class JobTemplate(models.Model):
    """A project's reusable job spec; `locked` fields cannot be overridden at submit."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="job_templates")
    name = models.CharField(max_length=100)
    description = models.CharField(max_length=500, blank=True)
    spec = models.JSONField(default=dict)
    locked = models.JSONField(default=list, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = JobTemplateQuerySet.as_manager()

    class Meta:
        ordering = ["project__slug", "name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="jobtemplate_unique_name")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.name}"
