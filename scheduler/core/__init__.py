"""Pure scheduler core: `schedule(snapshot) -> plan`. Imports no Django."""
from .model import (
    REASON_FRAGMENTED, REASON_LOCALITY, REASON_NODE_RESOURCES, REASON_SANDBOX, GPU, Allocation, Config, Dataset, Job,
    Node, OrgQuota, Plan, Preemption, ProjectQuota, Reason, Reservation, Snapshot, Start, sandbox_hosts,
)
from .ordering import decay_usage
from .placement import TOPO_LEVELS, Topology, topo_score
from .scheduling import schedule

__all__ = [
    "GPU", "Allocation", "Config", "Dataset", "Job", "Node", "OrgQuota", "Plan", "Preemption", "ProjectQuota",
    "REASON_FRAGMENTED", "REASON_LOCALITY", "REASON_NODE_RESOURCES", "REASON_SANDBOX", "Reason", "Reservation",
    "Snapshot", "Start",
    "TOPO_LEVELS", "Topology", "decay_usage", "topo_score",
    "sandbox_hosts", "schedule",
]
