"""Pure scheduler core: `schedule(snapshot) -> plan`. Imports no Django."""
from .model import (
    REASON_FRAGMENTED, REASON_NODE_RESOURCES, REASON_SANDBOX, GPU, Allocation, Config, Job, Node, OrgQuota, Plan,
    Preemption, ProjectQuota, Reason, Reservation, Snapshot, Start, sandbox_hosts,
)
from .ordering import decay_usage
from .placement import Topology
from .scheduling import schedule

__all__ = [
    "GPU", "Allocation", "Config", "Job", "Node", "OrgQuota", "Plan", "Preemption", "ProjectQuota",
    "REASON_FRAGMENTED", "REASON_NODE_RESOURCES", "REASON_SANDBOX", "Reason", "Reservation", "Snapshot", "Start",
    "Topology", "decay_usage",
    "sandbox_hosts", "schedule",
]
