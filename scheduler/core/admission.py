"""Admission: may this job run now at all, before asking where.

Checks a job against its project and organization quotas, the array throttle
and its dependencies, using running totals that the pass updates as it starts
jobs, so two jobs of one project cannot both squeeze under the same limit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .model import (
    REASON_ARRAY_THROTTLE, REASON_BUDGET, REASON_DEPENDENCY, REASON_GPU_TYPE, REASON_MAX_RUNNING,
    REASON_QUOTA_ORG, REASON_QUOTA_PROJECT, REASON_TIME_LIMIT, Allocation, Job, OrgQuota,
    ProjectQuota,
)

EPS = 1e-9


def fmt_gpus(g: float) -> str:
    """'2 GPUs', '1 GPU', '0.5 GPU' — whole numbers without a trailing .0."""
    if g == int(g):
        n = int(g)
        return f"{n} GPU" if n == 1 else f"{n} GPUs"
    return f"{g:g} GPU"


def fmt_num(g: float) -> str:
    return str(int(g)) if g == int(g) else f"{g:g}"


def fmt_duration(s: float) -> str:
    if s >= 86400 and s % 3600 == 0:
        return f"{s / 86400:g} d" if s % 86400 == 0 else f"{s / 3600:g} h"
    if s >= 3600:
        return f"{s / 3600:g} h"
    return f"{s:g} s"


@dataclass
class Tally:
    """What is in use, per project, organization and array, as the pass goes."""

    proj_gpus: dict[str, float] = field(default_factory=dict)
    proj_jobs: dict[str, int] = field(default_factory=dict)
    org_gpus: dict[str, float] = field(default_factory=dict)
    array_running: dict[str, int] = field(default_factory=dict)
    # Guaranteed GPUs claimed this pass by jobs that preempt to get them: keeps a
    # second job of the same project from preempting for the same guarantee.
    proj_claimed: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_running(cls, running: list[Allocation]) -> Tally:
        t = cls()
        pg, pj, og, ar = t.proj_gpus, t.proj_jobs, t.org_gpus, t.array_running
        for a in running:  # Tally.add inlined: this runs over every running job each pass
            job = a.job
            g = job.gpus if job.gpus > 0 else 0.0
            pg[job.project] = pg.get(job.project, 0.0) + g
            pj[job.project] = pj.get(job.project, 0) + 1
            og[job.org] = og.get(job.org, 0.0) + g
            if job.array_parent is not None:
                ar[job.array_parent] = ar.get(job.array_parent, 0) + 1
        return t

    def add(self, job: Job) -> None:
        g = max(job.gpus, 0.0)
        self.proj_gpus[job.project] = self.proj_gpus.get(job.project, 0.0) + g
        self.proj_jobs[job.project] = self.proj_jobs.get(job.project, 0) + 1
        self.org_gpus[job.org] = self.org_gpus.get(job.org, 0.0) + g
        if job.array_parent is not None:
            self.array_running[job.array_parent] = self.array_running.get(job.array_parent, 0) + 1

    def remove(self, job: Job) -> None:
        g = max(job.gpus, 0.0)
        self.proj_gpus[job.project] = self.proj_gpus.get(job.project, 0.0) - g
        self.proj_jobs[job.project] = self.proj_jobs.get(job.project, 0) - 1
        self.org_gpus[job.org] = self.org_gpus.get(job.org, 0.0) - g
        if job.array_parent is not None:
            self.array_running[job.array_parent] = self.array_running.get(job.array_parent, 0) - 1

    def borrowed(self, job: Job, proj: ProjectQuota | None) -> bool:
        """Would starting `job` now take the project above its guarantee?"""
        if job.gpus <= 0:
            return False
        guaranteed = proj.guaranteed_gpus if proj else 0.0
        return self.proj_gpus.get(job.project, 0.0) + job.gpus > guaranteed + EPS

    def within_guarantee(self, job: Job, proj: ProjectQuota | None) -> bool:
        """May `job` preempt? Only for GPUs the project is guaranteed and has
        not already claimed in this pass."""
        if proj is None or job.gpus <= 0:
            return False
        used = self.proj_gpus.get(job.project, 0.0) + self.proj_claimed.get(job.project, 0.0)
        return used + job.gpus <= proj.guaranteed_gpus + EPS


def check_type(job: Job, proj: ProjectQuota | None, models: set[str]) -> tuple[str, str] | None:
    """GPU type allowed for the project and present in the cluster at all."""
    if job.gpus <= 0:
        return None
    if job.gpu_type is not None:
        if proj is not None and proj.allowed_gpu_types and job.gpu_type not in proj.allowed_gpu_types:
            allowed = ", ".join(proj.allowed_gpu_types)
            return (REASON_GPU_TYPE,
                    f"GPU type {job.gpu_type} is not allowed for project {job.project} "
                    f"(allowed: {allowed}); resubmit with one of those")
        if job.gpu_type not in models:
            return (REASON_GPU_TYPE,
                    f"No schedulable GPU of type {job.gpu_type} in the cluster; "
                    f"resubmit without gpu_type or wait for such nodes to return")
    elif proj is not None and proj.allowed_gpu_types and not set(proj.allowed_gpu_types) & models:
        return (REASON_GPU_TYPE,
                f"None of the GPU types allowed for project {job.project} "
                f"({', '.join(proj.allowed_gpu_types)}) is schedulable in the cluster")
    return None


def admit(job: Job, proj: ProjectQuota | None, org: OrgQuota | None, tally: Tally,
          models: set[str]) -> tuple[str, str] | None:
    """None when the job may start now as far as limits go, else (code, sentence).

    A project missing from the snapshot has no limits and no guarantee: all its
    GPUs are borrowed."""
    g = max(job.gpus, 0.0)
    if not job.deps_satisfied:
        return (REASON_DEPENDENCY, "Waiting for the jobs it depends on to finish successfully")
    if proj is not None:
        if proj.max_time_limit is not None and job.time_limit > proj.max_time_limit + EPS:
            return (REASON_TIME_LIMIT,
                    f"Time limit {fmt_duration(job.time_limit)} exceeds project {job.project}'s "
                    f"maximum of {fmt_duration(proj.max_time_limit)}; resubmit with a shorter limit")
        if proj.gpu_hours_budget is not None and g > 0 and proj.gpu_hours_used >= proj.gpu_hours_budget - EPS:
            return (REASON_BUDGET,
                    f"Project {job.project} has used {proj.gpu_hours_used:.1f} of its "
                    f"{proj.gpu_hours_budget:.1f} GPU-hour budget; an owner must raise the budget")
    bad_type = check_type(job, proj, models)
    if bad_type:
        return bad_type
    if job.array_parent is not None and job.array_limit is not None:
        n = tally.array_running.get(job.array_parent, 0)
        if n >= job.array_limit:
            return (REASON_ARRAY_THROTTLE,
                    f"Array {job.array_parent} already runs {n}/{job.array_limit} tasks "
                    f"(its %{job.array_limit} limit); waits for one to finish")
    if proj is not None:
        running = tally.proj_jobs.get(job.project, 0)
        if proj.max_running_jobs is not None and running >= proj.max_running_jobs:
            return (REASON_MAX_RUNNING,
                    f"Project {job.project} runs {running}/{proj.max_running_jobs} jobs, "
                    f"its maximum; waits for one to finish")
        used = tally.proj_gpus.get(job.project, 0.0)
        if g > 0 and used + g > proj.max_gpus + EPS:
            return (REASON_QUOTA_PROJECT,
                    f"Waiting for {fmt_gpus(g)}: project quota {fmt_num(used)}/{fmt_num(proj.max_gpus)} in use")
    if org is not None and org.max_gpus is not None and g > 0:
        used = tally.org_gpus.get(job.org, 0.0)
        if used + g > org.max_gpus + EPS:
            return (REASON_QUOTA_ORG,
                    f"Waiting for {fmt_gpus(g)}: organization {job.org} quota "
                    f"{fmt_num(used)}/{fmt_num(org.max_gpus)} in use")
    return None
