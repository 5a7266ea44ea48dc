"""A job's launch spec: what the agent on a node needs to start its part of the job.

Composed here, above the apps that give its parts: jobs (the job, its GPUs, a gang's rendezvous),
storage (the files of its datasets, presigned when the spec is sent) and interactive (its published
ports). The scheduler's pass sends it with each launch; the agent API's confirm returns it.
"""
from django.conf import settings
from django.core.cache import cache

from portal.interactive.selectors import launch_sessions
from portal.jobs.selectors import job_launch_parts
from portal.storage.selectors import launch_datasets


def _cache_key(node_name: str, job_id: int, attempt: int) -> str:
    return f"launch-spec:{node_name}:{job_id}:{attempt}"


def launch_spec(job_id: int, node_name: str, attempt: int | None = None) -> dict | None:
    """What the agent on `node_name` needs to start its part of the job, or None if the job
    no longer holds GPUs there. With `attempt` (an agent's confirmation, which has just checked
    that the node holds that attempt), the spec the pass built for it moments ago is answered
    from the cache when it is there (LAUNCH_SPEC_CACHE_S), instead of three queries. A spec built
    here is not cached: its confirmation is this call, and no one reads it back."""
    if attempt is not None and (spec := cache.get(_cache_key(node_name, job_id, attempt))) is not None:
        return spec
    return _launch_specs([(node_name, job_id)]).get((node_name, job_id))


def confirmed_launch_specs(node_name: str, attempts: dict[int, int]) -> dict[int, dict]:
    """``launch_spec`` for several jobs of one node, each at the attempt just confirmed (job id ->
    attempt): those the pass cached in one read, the others built together."""
    keys = {job_id: _cache_key(node_name, job_id, attempt) for job_id, attempt in attempts.items()}
    cached = cache.get_many(list(keys.values())) if keys else {}
    specs = {job_id: cached[key] for job_id, key in keys.items() if key in cached}
    missing = [(node_name, job_id) for job_id in attempts if job_id not in specs]
    if missing:
        specs |= {job_id: spec for (_, job_id), spec in _launch_specs(missing).items()}
    return specs


def launch_specs(pairs: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """Launch specs for (node name, job id) pairs in at most five queries, whatever their number.
    Each is kept in the cache for LAUNCH_SPEC_CACHE_S for its confirmation (launch_spec); not
    one with datasets, whose presigned URLs are made afresh when the node confirms."""
    specs = _launch_specs(pairs)
    keep = {_cache_key(node, job_id, spec["attempt"]): spec for (node, job_id), spec in specs.items()
            if not spec["datasets"]}
    if keep and settings.LAUNCH_SPEC_CACHE_S > 0:
        cache.set_many(keep, timeout=settings.LAUNCH_SPEC_CACHE_S)
    return specs


def _launch_specs(pairs: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    specs = job_launch_parts(pairs)
    sessions = launch_sessions(list({job_id for _, job_id in specs}))
    # Each job's files once, whichever of its nodes they go to.
    datasets = launch_datasets({job_id: spec["datasets"] for (_, job_id), spec in specs.items()})
    for (_, job_id), spec in specs.items():
        spec["datasets"] = datasets.get(job_id, [])  # read-only at /datasets/<name> (agents/datasets.py)
        # Published ports (docs/sessions.md) go to a gang's first node (rank 0) only: a gang cannot
        # publish any yet.
        first = spec["rendezvous"] is None or spec["rendezvous"]["NODE_RANK"] == "0"
        spec["sessions"] = sessions.get(job_id, []) if first else []
    return specs
