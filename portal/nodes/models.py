from django.db import models


class NodeState(models.TextChoices):
    READY = "ready", "Ready"  # takes new jobs
    DRAINING = "draining", "Draining"  # no new jobs; running ones finish, then drained
    DRAINED = "drained", "Drained"  # empty and out of service until an operator undrains it
    DOWN = "down", "Down"  # silent past the heartbeat timeout; its jobs ended node_fail


class Node(models.Model):
    """A GPU machine running one agent. Staff-only: tenants never see node rows directly."""

    name = models.CharField(max_length=63, unique=True)
    state = models.CharField(max_length=10, choices=NodeState.choices, default=NodeState.READY)
    state_reason = models.CharField(max_length=200, blank=True)
    pool = models.CharField(max_length=63, default="default")
    labels = models.JSONField(default=dict, blank=True)
    cpus = models.PositiveIntegerField(default=0)
    memory_mb = models.PositiveIntegerField(default=0)
    sandbox = models.CharField(max_length=16, blank=True)  # what the agent reported: docker, kvm, process
    # What the agent says it can enforce, e.g. {"mps": false}: a fractional job's share needs CUDA MPS.
    capabilities = models.JSONField(default=dict, blank=True)
    # The agent protocol its agent spoke at its last registration ("": an agent older than the field).
    protocol_version = models.CharField(max_length=16, blank=True, default="")
    # The dataset versions its agent's cache holds, complete and verified: sha256 digests (64 hex), as the
    # agent last reported them at registration or in a heartbeat (agents/datasets.py). The scheduler
    # prefers nodes that already hold a job's datasets (Job.datasets).
    cached_datasets = models.JSONField(default=list, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # sha256 of the node's agent token (gpn_...); the secret is shown once by add_node.
    token_digest = models.CharField(max_length=64, blank=True, db_index=True)
    # A node takes jobs only once its agent has registered and proved it receives its own queue
    # node.<name> (a wrong --broker or queue folder would leave launches unread): at each
    # registration the portal sends a probe there with a fresh nonce, and the agent answers it
    # through the agent API (services.agent_register, agent_probe_answer).
    agent_registered_at = models.DateTimeField(null=True, blank=True)
    queue_probe = models.CharField(max_length=32, blank=True)  # nonce of the probe awaiting its answer
    queue_probe_sent_at = models.DateTimeField(null=True, blank=True)
    queue_verified_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def schedulable(self) -> bool:
        return self.state == NodeState.READY and self.queue_verified_at is not None

    @property
    def waiting_for(self) -> str:
        """Why the node takes no jobs yet, in words an operator can act on ("" once it does)."""
        from portal.celery import node_queue  # the Celery app loads after the models (portal/__init__.py)

        if self.queue_verified_at is not None:
            return ""
        if self.agent_registered_at is None:
            return (f"waiting for its agent to register: start it with this node's token "
                    f"(python -m agents --portal URL --token gpn_... --name {self.name})")
        return (f"waiting for the agent to receive its queue {node_queue(self.name)}: check --broker and "
                f"the queue folder")


class GPUMode(models.TextChoices):
    WHOLE = "whole", "Whole GPU per job"
    SHARED = "shared", "Shared by fractional jobs"


class GPUHealth(models.TextChoices):
    HEALTHY = "healthy", "Healthy"
    UNHEALTHY = "unhealthy", "Unhealthy"  # hot, Xid or ECC errors: no new placements


class GPU(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64, unique=True)
    model = models.CharField(max_length=64)  # e.g. H100-80GB
    memory_mb = models.PositiveIntegerField()
    pci_bus_id = models.CharField(max_length=32, blank=True)
    # What the probe read of its interconnect: {"nvlink": id, "pcie": id, "numa": id} (an id or None
    # per level; {} when not reported). The scheduler keeps a job's GPUs in the tightest domain.
    topology = models.JSONField(default=dict, blank=True)
    mode = models.CharField(max_length=8, choices=GPUMode.choices, default=GPUMode.WHOLE)
    health = models.CharField(max_length=10, choices=GPUHealth.choices, default=GPUHealth.HEALTHY)
    health_reason = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index} ({self.model})"


class ReaperState(models.Model):
    """One row (pk=1): when the reaper last ran, and since when every node's lease counts.

    A reaper that could not run for a while (database, broker or every portal process down)
    has not heard heartbeats either, and that silence is the portal's, not the nodes': its
    next run gives every node a fresh lease from `leases_fresh_since` before it reaps anyone.
    A portal that hears heartbeats late (overloaded) records its lag in `ingest_lag_s`.
    """

    last_run_at = models.DateTimeField()
    leases_fresh_since = models.DateTimeField()
    # The portal's heartbeat ingest lag (seconds) and when it was last measured above the heartbeat
    # interval: while it is (and for NODE_TIMEOUT_S after), every node's deadline is that much later.
    ingest_lag_s = models.FloatField(default=0.0)
    ingest_lag_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"reaper ran {self.last_run_at:%Y-%m-%d %H:%M:%S}"
