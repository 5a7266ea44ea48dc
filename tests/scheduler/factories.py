"""Small builders for scheduler-core tests: a cluster, a job, a snapshot."""
from __future__ import annotations

from scheduler.core import GPU, Allocation, Config, Job, Node, OrgQuota, ProjectQuota, Snapshot

NOW = 1_000_000.0


def nodes(n: int = 2, per: int = 8, model: str = "A100", pool: str = "default", shared: bool = False,
          prefix: str = "n", memory_mb: int = 81920) -> list[Node]:
    out = []
    for i in range(n):
        name = f"{prefix}{i}"
        out.append(Node(name, pool, [GPU(f"{name}-{k}", name, k, model, memory_mb, shared=shared)
                                     for k in range(per)]))
    return out


def job(id: str, gpus: float = 1, project: str = "alice", submit: float = NOW - 100, time_limit: float = 3600,
        **kw) -> Job:
    org = kw.pop("org", f"org-{project}")
    return Job(id, project, org, kw.pop("user", project), float(gpus), submit, time_limit, **kw)


def running(j: Job, gpu_ids: list[str], start: float = NOW - 3600, **kw) -> Allocation:
    return Allocation(j, gpu_ids, start, **kw)


def quota(project: str, guaranteed: float = 16, max_gpus: float = 16, **kw) -> ProjectQuota:
    return ProjectQuota(project, kw.pop("org", f"org-{project}"), guaranteed, max_gpus, **kw)


def snapshot(cluster: list[Node], queued: list[Job], run: list[Allocation] | None = None,
             projects: dict[str, ProjectQuota] | None = None, orgs: dict[str, OrgQuota] | None = None,
             usage: dict[str, float] | None = None, now: float = NOW, **cfg) -> Snapshot:
    if projects is None:
        names = {j.project for j in queued} | {a.job.project for a in run or []}
        total = sum(len(n.gpus) for n in cluster)
        projects = {p: quota(p, 100 * total, 100 * total) for p in names}  # limits out of the way
    return Snapshot(now, cluster, run or [], queued, projects, orgs or {}, usage or {}, Config(**cfg))


def started(plan) -> dict[str, list[str]]:
    return {s.job_id: s.gpu_ids for s in plan.starts}
