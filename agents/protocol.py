"""The contract between the portal and its node agents, written once.

Plain Python with no Django and no portal import: the agent imports it, and so do the portal
(the agent API, job submission, report handling) and the scheduler core. A rule both sides must
agree on lives here and nowhere else; tests/core/test_protocol.py fails when a copy reappears.
"""

from __future__ import annotations

# The version of the agent API's message shapes, "MAJOR.MINOR", sent at registration. The portal
# refuses an agent whose major differs (its messages would be misread); a minor adds optional
# fields only. An agent that sends no version predates this field and speaks 1.x.
PROTOCOL_VERSION = "1.1"  # 1.1: a terminal event may say lease_expired


def protocol_major(version: str) -> int:
    """The major of a "MAJOR.MINOR" version; ValueError when it is not one."""
    major, sep, minor = version.partition(".")
    if not (sep and major.isdigit() and minor.isdigit()):
        raise ValueError(f"{version!r} is not a MAJOR.MINOR version")
    return int(major)


# -- sandboxes -------------------------------------------------------------------------------------

# What a job may ask for, and what a node's agent may run (``process`` isolates nothing: only for
# machines without Docker, and it takes docker jobs there).
JOB_SANDBOXES = ("docker", "kvm")
NODE_SANDBOXES = ("docker", "kvm", "process")
DEFAULT_SANDBOX = "docker"
# Which node sandboxes run a job's sandbox. A VM is never swapped for a container: a job that asked
# for kvm isolation gets it.
SANDBOX_HOSTS = {"docker": ("docker", "process"), "kvm": ("kvm",)}


def sandbox_hosts(sandbox: str) -> tuple[str, ...]:
    """The node sandboxes that may run a job asking for ``sandbox`` (an unknown one: only itself)."""
    return SANDBOX_HOSTS.get(sandbox, (sandbox,))


# -- environment names -----------------------------------------------------------------------------

# Env names a job may not set, in any letter case. The prefixes steer the GPU stack, the dynamic
# loader (the NVIDIAScape escape used LD_PRELOAD) or are the agent's own; the rendezvous names are
# set by the agent for a gang. The portal refuses them at submit; the agent drops them again so a
# bug there cannot become an escape.
RESERVED_ENV_PREFIXES = ("CUDA_", "NVIDIA_", "LD_", "GPUPORTAL_")
RENDEZVOUS_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")


def is_reserved_env(name: str) -> bool:
    upper = str(name).upper()
    return upper.startswith(RESERVED_ENV_PREFIXES) or upper in RENDEZVOUS_KEYS


# -- job events ------------------------------------------------------------------------------------

# The states an agent reports for an attempt (POST .../events), and the ones that end it. The
# portal's own job states are a superset (queued, assigned, preempted, node_fail are its verdicts).
EVENT_STATES = ("starting", "running", "succeeded", "failed", "timeout", "oom", "cancelled")
TERMINAL_EVENT_STATES = frozenset({"succeeded", "failed", "timeout", "oom", "cancelled"})
