"""Node pools the portal scales, the nodes it started in them, and every scaling event (docs/autoscaling.md)."""
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from portal.nodes.services import NODE_NAME


class Provider(models.TextChoices):
    LOCAL = "local", "Agents on this machine with simulated GPUs"
    COMMAND = "command", "Operator scripts (like Slurm's ResumeProgram and SuspendProgram)"
    LIBCLOUD = "libcloud", "A cloud through Apache libcloud"


class NodePool(models.Model):
    """Nodes of one shape from one provider, scaled between min_nodes and max_nodes."""

    name = models.SlugField(max_length=40, unique=True)  # also the nodes' Node.pool and their name prefix
    provider = models.CharField(max_length=16, choices=Provider.choices, default=Provider.LOCAL)
    # Provider options: local {"portal_url", "sandbox"}; command {"resume_program", "suspend_program",
    # "list_program", "timeout_s"}; libcloud {"driver", "key", "secret", "driver_args", "size", "image", ...}.
    provider_config = models.JSONField(default=dict, blank=True)
    enabled = models.BooleanField(default=True)
    # The shape: every node of the pool has gpus_per_node GPUs of gpu_model.
    gpu_model = models.CharField(max_length=64, default="H100-80GB")
    gpus_per_node = models.PositiveSmallIntegerField(default=8, validators=[MinValueValidator(1)])
    price_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4, default=0)
    sandbox = models.CharField(max_length=16, default="docker")  # what its agents run
    min_nodes = models.PositiveIntegerField(default=0)
    max_nodes = models.PositiveIntegerField(default=8)
    max_per_step = models.PositiveIntegerField(default=4, validators=[MinValueValidator(1)])
    idle_release_s = models.PositiveIntegerField(default=600)
    boot_timeout_s = models.PositiveIntegerField(default=600, validators=[MinValueValidator(1)])
    max_concurrent_releases = models.PositiveIntegerField(default=2, validators=[MinValueValidator(1)])
    # Money cap for the whole pool: price x GPUs x nodes may not pass it (None: no cap).
    max_cost_per_hour = models.DecimalField(max_digits=12, decimal_places=2, null=True, blank=True)
    # Back-off: after a provider error or a node that never registered the shape is unavailable
    # until then; consecutive failures double the wait (backoff_s, 2x, 4x ... up to an hour).
    backoff_s = models.PositiveIntegerField(default=300)
    unavailable_until = models.DateTimeField(null=True, blank=True)
    unavailable_reason = models.CharField(max_length=300, blank=True)
    failures = models.PositiveIntegerField(default=0)
    next_index = models.PositiveIntegerField(default=1)  # node names: <pool>-<index>, never reused
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self):
        if self.max_nodes < self.min_nodes:
            raise ValidationError({"max_nodes": "Must be at least min_nodes."})
        if not NODE_NAME.match(f"{self.name}-1"):
            raise ValidationError({"name": "Use lowercase letters, digits and hyphens (node names start with it)."})
        # providers imports this module's models at its top: importing it here instead breaks the cycle.
        from .providers import provider_for

        try:
            provider_for(self).check()
        except Exception as exc:  # the provider says what is wrong with its options
            raise ValidationError({"provider_config": str(exc)}) from exc


class PoolNodeState(models.TextChoices):
    BOOTING = "booting", "Booting"  # created by the provider; its agent has not registered yet
    READY = "ready", "Ready"  # its agent registered and takes jobs
    RELEASING = "releasing", "Releasing"  # drained by the autoscaler; the provider is deleting it
    RELEASED = "released", "Released"  # deleted by the provider; no longer paid for
    FAILED = "failed", "Failed"  # the provider could not create it, or it never registered


class PoolNode(models.Model):
    """A node the autoscaler asked a provider for: paid from created_at until released_at."""

    pool = models.ForeignKey(NodePool, on_delete=models.PROTECT, related_name="pool_nodes")
    name = models.CharField(max_length=63, unique=True)
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    state = models.CharField(max_length=10, choices=PoolNodeState.choices, default=PoolNodeState.BOOTING,
                             db_index=True)
    provider_id = models.CharField(max_length=200, blank=True)  # the provider's own id (a cloud instance id)
    gpus = models.PositiveSmallIntegerField()  # what it was created with (its shape then)
    price_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4, default=0)
    jobs = models.JSONField(default=list, blank=True)  # booting: ids of the waiting jobs it is for
    reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField()
    registered_at = models.DateTimeField(null=True, blank=True)
    release_started_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["pool", "created_at", "name"]

    def __str__(self) -> str:
        return self.name


class ScaleEvent(models.Model):
    """One thing the autoscaler did or refused, with its reason: the pool's audit trail."""

    class Kind(models.TextChoices):
        SCALE_UP = "scale_up", "Scale up"
        REGISTERED = "registered", "Node registered"
        RELEASE = "release", "Release (drained)"
        CONSOLIDATE = "consolidate", "Consolidate (jobs moved off)"
        RELEASED = "released", "Released"
        BOOT_TIMEOUT = "boot_timeout", "Boot timeout"
        PROVIDER_ERROR = "provider_error", "Provider error"
        UNAVAILABLE = "unavailable", "Shape unavailable (back-off)"
        LIMITED = "limited", "Scale-up limited"

    pool = models.ForeignKey(NodePool, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(db_index=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    nodes = models.JSONField(default=list, blank=True)
    delta = models.IntegerField(default=0)  # nodes added (+) or released (-)
    size_after = models.PositiveIntegerField(default=0)  # live nodes of the pool after the event
    demand_gpus = models.DecimalField(max_digits=10, decimal_places=3, default=0)
    reason = models.CharField(max_length=500)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.pool.name} {self.kind} {self.at:%H:%M:%S}"
