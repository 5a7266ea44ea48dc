"""How gpuctl prints: `-o json` is one JSON document on stdout; `-o table` is for people.

Progress (watching, following) goes to stdout with tables and to stderr with JSON, so that
`gpuctl ... -o json | jq` always reads exactly one document.
"""
import json
import shlex
import sys
from datetime import datetime
from enum import Enum

# The job states in which nothing more happens. A copy of portal.jobs.models.TERMINAL (this
# package imports no Django); tests/cli/test_offline.py keeps the two equal.
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "timeout", "node_fail", "oom"})


class Format(str, Enum):
    table = "table"
    json = "json"


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def say(text: str = "", *, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def table(rows: list[list], headers: list[str], *, max_width: dict[int, int] | None = None) -> str:
    """Columns padded to their widest cell, like `kubectl get`; cells cut to max_width[column]."""
    max_width = max_width or {}

    def cell(i, value) -> str:
        text = "" if value is None else str(value).replace("\n", " ")
        limit = max_width.get(i)
        return text if not limit or len(text) <= limit else text[: limit - 1] + "…"

    cells = [[cell(i, v) for i, v in enumerate(row)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def when(value: str | None, *, short: bool = False) -> str:
    """An API timestamp in local time."""
    if not value:
        return "-"
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone()
    except ValueError:
        return value
    return moment.strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S")


def duration(seconds: int | None) -> str:
    """3600 -> '1h', 5400 -> '1h30m', 90061 -> '1d1h1m1s'."""
    if not seconds:
        return "-"
    parts, rest = [], int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(parts)


def number(value) -> str:
    """2.0 -> '2', 0.5 -> '0.5'."""
    if value is None:
        return "-"
    value = float(value)
    return str(int(value)) if value.is_integer() else f"{value:g}"


def resources(res: dict) -> str:
    gpus = number(res.get("gpus"))
    gpu = f"{gpus} GPU" + (f" {res['gpu_type']}" if res.get("gpu_type") else "")
    if res.get("gpu_memory_mb"):
        gpu += f" ({res['gpu_memory_mb']} MB)"
    if (res.get("nodes") or 1) > 1:
        gpu += f" on {res['nodes']} nodes ({number(res.get('gpus_per_node'))} each)"
    return f"{gpu}, {number(res.get('cpus'))} CPU, {res.get('memory_mb')} MB"


def tasks_summary(tasks: dict | None) -> str:
    """An array parent's task histogram: '3 running, 5 queued'."""
    if not tasks:
        return ""
    return ", ".join(f"{n} {state}" for state, n in sorted(tasks.items(), key=lambda kv: (-kv[1], kv[0])))


def job_note(job: dict) -> str:
    """The one thing to know about a job now: why it waits, where it runs, how it ended."""
    reason = (job.get("reason") or {}).get("message", "")
    if job.get("is_array_parent") and job.get("tasks"):
        return "tasks: " + tasks_summary(job["tasks"])
    if job["state"] == "queued":
        position = job.get("queue_position")
        return f"queue position {position}: {reason}" if position else reason
    if job["state"] in TERMINAL:
        if job.get("exit_code") is not None and job["state"] in ("succeeded", "failed"):
            return f"exit code {job['exit_code']}" + (f": {reason}" if reason and job["state"] != "succeeded" else "")
        return reason
    return f"on {job['node']}" if job.get("node") else reason


def job_ref(job: dict) -> str:
    """An array task as Slurm names it, 3_0; any other job by its id."""
    if job.get("array_parent"):
        return f"{job['array_parent']}_{job.get('array_index')}"
    return str(job["id"])


def job_table(jobs: list[dict]) -> str:
    rows = [[job_ref(j), j["project"], j["user"], j["name"],
             j["state"] + (" (held)" if j.get("held") and j["state"] == "queued" else ""),
             number(j["resources"]["gpus"]), when(j["submitted_at"], short=True),
             "0s" if j.get("elapsed") == 0 else duration(j.get("elapsed")), job_note(j)] for j in jobs]
    return table(rows, ["ID", "PROJECT", "USER", "NAME", "STATE", "GPUS", "SUBMITTED", "ELAPSED", "NOTE"],
                 max_width={3: 32, 8: 80})


def job_detail(job: dict) -> str:
    """`gpuctl show`: the job, why it waits (or how it ended), and its timeline."""
    flags = [job["priority"]] + [f for f in ("preemptible", "network") if job.get(f)]
    lines = [f"Job {job_ref(job)}  {job['name']}"]
    fields: list[tuple[str, str]] = [
        ("state", f"{job['state']} [{job.get('slurm_code') or '-'}]" + (
            f", attempt {job['attempt']}" if job.get("attempt", 1) > 1 else "")),
    ]
    reason = job.get("reason") or {}
    if job["state"] not in TERMINAL or reason:
        if reason:
            fields.append(("reason", f"{reason.get('message', '')} ({reason.get('code', '')})"))
        if job["state"] == "queued" and job.get("queue_position"):
            fields.append(("position", f"{job['queue_position']} in queue"))
    fields += [
        ("project", f"{job['project']} (submitted by {job['user']})"),
        ("image", job["image"]),
        ("command", shlex.join(job.get("command") or [])),
        ("resources", resources(job["resources"])),
        ("time limit", duration(job.get("time_limit"))),
        ("priority", ", ".join(flags)),
    ]
    if job.get("env"):
        fields.append(("env", " ".join(f"{k}={v}" for k, v in sorted(job["env"].items()))))
    if job.get("template"):
        fields.append(("template", job["template"]))
    if job.get("array"):
        fields.append(("array", job["array"] + (f"  tasks: {tasks_summary(job.get('tasks'))}"
                                                 if job.get("tasks") else "")))
    if job.get("array_parent"):
        fields.append(("array task", f"{job.get('array_index')} of job {job['array_parent']}"))
    if job.get("depends_on"):
        fields.append(("depends on", ", ".join(str(d) for d in job["depends_on"])))
    if job.get("resubmit_of"):
        fields.append(("resubmit of", str(job["resubmit_of"])))
    if job.get("node"):
        fields.append(("node", job["node"]))
    if job.get("exit_code") is not None:
        fields.append(("exit code", str(job["exit_code"])))
    fields += [("submitted", when(job.get("submitted_at"))), ("started", when(job.get("started_at"))),
               ("ended", when(job.get("ended_at")))]
    width = max(len(k) for k, _ in fields) + 1
    lines += [f"  {(k + ':').ljust(width)} {v}" for k, v in fields]
    lines += ["", "Timeline:", f"  {when(job.get('submitted_at'))}  submitted"]
    for event in job.get("events") or []:
        attempt = f"  (attempt {event['attempt']})" if event.get("attempt", 1) > 1 else ""
        message = f"  {event['message']}" if event.get("message") else ""
        lines.append(f"  {when(event['at'])}  {event['state']}{attempt}{message}")
    return "\n".join(lines)


def project_table(projects: list[dict]) -> str:
    rows = []
    for p in projects:
        q = p.get("quota") or {}
        budget = q.get("gpu_hours_budget")
        rows.append([p["slug"], p.get("role") or "-", number(q.get("guaranteed_gpus")), number(q.get("max_gpus")),
                     q.get("max_running_jobs", "-"), duration(q.get("max_time_limit_s")),
                     "-" if budget is None else number(budget) + (" (hard)" if q.get("budget_hard_stop") else ""),
                     "yes" if q.get("network_allowed") else "no"])
    return table(rows, ["PROJECT", "ROLE", "GUARANTEED", "MAX GPUS", "MAX RUNNING", "MAX TIME",
                        "GPU-H/MONTH", "NETWORK"])


def project_detail(project: dict) -> str:
    q = project.get("quota") or {}
    budget = q.get("gpu_hours_budget")
    fields = [
        ("organization", project.get("organization") or "-"),
        ("your role", project.get("role") or "-"),
        ("guaranteed GPUs", number(q.get("guaranteed_gpus"))),
        ("max GPUs", number(q.get("max_gpus"))),
        ("max running jobs", str(q.get("max_running_jobs", "-"))),
        ("max time limit", duration(q.get("max_time_limit_s"))),
        ("GPU-hour budget", "none" if budget is None else f"{number(budget)} per month"
                            + (", hard stop" if q.get("budget_hard_stop") else "")),
        ("GPU types", ", ".join(q.get("allowed_gpu_types") or []) or "any"),
        ("images", ", ".join(q.get("allowed_images") or []) or "any"),
        ("network", "allowed" if q.get("network_allowed") else "not allowed"),
    ]
    width = max(len(k) for k, _ in fields) + 1
    return "\n".join([f"Project {project['slug']}  {project.get('name', '')}"]
                     + [f"  {(k + ':').ljust(width)} {v}" for k, v in fields])


def cluster_tables(cluster: dict) -> str:
    """`gpuctl nodes`: GPUs by pool and type like sinfo, then totals by type and the queue."""
    rows = [[r["pool"], r["gpu_type"], ", ".join(f"{n} {s}" for s, n in r["node_states"].items()),
             r["total"], number(r["used"]), r["free"], r["unavailable"]] for r in cluster["pools"]]
    if not rows:
        return "No GPU node has registered yet."
    out = [table(rows, ["POOL", "GPU TYPE", "NODES", "GPUS", "USED", "FREE", "UNAVAILABLE"])]
    if len(cluster["gpu_types"]) > 1 or len(cluster["pools"]) > 1:
        types = [[t["gpu_type"], t["total"], number(t["used"]), t["free"], t["unavailable"]]
                 for t in cluster["gpu_types"]]
        out += ["", table(types, ["GPU TYPE", "GPUS", "USED", "FREE", "UNAVAILABLE"])]
    jobs = cluster["jobs"]
    out += ["", f"{jobs['running']} jobs holding GPUs or starting; {jobs['queued']} queued asking for "
                f"{number(jobs['queued_gpus'])} GPUs."]
    return "\n".join(out)


def percent(ratio) -> str:
    return "-" if ratio is None else f"{ratio * 100:.0f}%"


def money(amount, currency: str = "") -> str:
    if amount is None or amount == "":
        return "-"
    return f"{float(amount):.2f}" + (f" {currency}" if currency else "")


def job_usage_table(doc: dict) -> str:
    """`gpuctl usage`: one row per job, like sacct with seff's efficiency."""
    rows = [[r["slurm_id"], r["name"], r["project"], r["user"], r["state"], number(r["gpus"]),
             "0s" if r.get("elapsed") == 0 else duration(r.get("elapsed")), f"{r['gpu_hours']:.2f}",
             percent(r.get("gpu_efficiency")), money(r.get("amount"), r.get("currency", ""))]
            for r in doc["results"]]
    total = doc["total"]
    return "\n".join([
        table(rows, ["ID", "NAME", "PROJECT", "USER", "STATE", "GPUS", "ELAPSED", "GPU-H", "GPU EFF", "COST"],
              max_width={1: 32}),
        "", f"{len(rows)} of {doc['count']} jobs: {total['gpu_hours']:.2f} GPU-hours, cost {money(total['amount'])}.",
    ])


def job_efficiency(row: dict) -> str:
    """`gpuctl usage ID`: seff's report for one job."""
    fields = [
        ("state", row["state"] + (f" (exit code {row['exit_code']})" if row.get("exit_code") is not None else "")),
        ("project", f"{row['project']} (submitted by {row['user']})"),
        ("GPUs", number(row["gpus"]) + (f" {', '.join(row['gpu_types'])}" if row.get("gpu_types") else "")),
        ("elapsed", "0s" if row.get("elapsed") == 0 else duration(row.get("elapsed"))),
        ("GPU-hours", f"{row['gpu_hours']:.3f} allocated"),
        ("GPU efficiency", "no utilization samples" if row.get("gpu_efficiency") is None else
         f"{percent(row['gpu_efficiency'])} (mean GPU utilization over its allocation)"),
        ("cost", money(row.get("amount"), row.get("currency", "")) + ("" if row.get("amount") is not None
                                                                      else " (not metered yet)")),
    ]
    width = max(len(k) for k, _ in fields) + 1
    return "\n".join([f"Job {row['slurm_id']}  {row['name']}"] + [f"  {(k + ':').ljust(width)} {v}" for k, v in fields])


def usage_group_table(doc: dict) -> str:
    """`gpuctl usage --by project|user|...`: GPU-hours and cost per group, then the total."""
    key = doc["group_by"]
    rows = [[r[key], number(r["gpu_hours"]), money(r["amount"])] for r in doc["results"]]
    rows.append(["TOTAL", number(doc["total"]["gpu_hours"]), money(doc["total"]["amount"])])
    return table(rows, [key.upper().replace("_", " "), "GPU-H", "COST"])
