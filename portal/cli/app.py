"""The gpuctl commands (docs/cli.md). Each one reads the config, makes its API calls, prints.

Exit status: 0 ok; 1 any other failure (and a watched job that did not succeed); 2 invalid
input (HTTP 400, a bad spec file or flag); 3 not logged in or not allowed (401/403); 4 not found
(404); 5 the job's state forbids it (409); 130 interrupted.
"""
import copy
import functools
import json
import os
import shlex
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from . import config, fastparams, version
from .client import ApiError, Client, ConnectionFailed
from .output import (TERMINAL, Format, cluster_tables, emit_json, job_detail, job_efficiency, job_note, job_table,
                     job_usage_table, project_detail, project_table, say, table, usage_group_table)
from .sessions import SessionError, find_session, port_forward as forward, shell as shell_run

fastparams.install()  # plain option values without pydantic (start-up time)

app = typer.Typer(
    name="gpuctl",
    help="Submit and follow jobs on a gpuportal. Start with: gpuctl login --url https://portal.example.com",
    no_args_is_help=True,
    # A traceback with locals would print the token; a bug report needs the stack only.
    pretty_exceptions_show_locals=False,
)

OutputOpt = Annotated[Format, typer.Option("--output", "-o", case_sensitive=False,
                                           help="table for people; json prints one JSON document on stdout.")]
IntervalOpt = Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between polls.")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", min=0,
                                                  help="Stop waiting after this many seconds (exit 1).")]
WatchOpt = Annotated[bool, typer.Option("--watch", "-w",
                                        help="Poll until the job ends, printing each state change and why it "
                                             "waits; exit 0 only if it succeeded.")]


JobRefArg = Annotated[str, typer.Argument(metavar="ID", help="A job id, or an array task as 3_0.")]
JobRefsArg = Annotated[list[str], typer.Argument(metavar="ID...", help="Job ids, or array tasks as 3_0.")]


class SpecError(Exception):
    """A spec file or flag gpuctl cannot turn into a spec (exit 2, like an API 400)."""


class _GaveUp(Exception):
    """The --timeout deadline passed while polling."""


_opened: list[Client] = []  # closed when the command ends (the tests run many commands in one process)


def _print_api_error(exc: ApiError) -> None:
    say(f"error: {exc.message}", err=True)
    for field, messages in exc.fields.items():
        for message in messages:
            say(f"  {field}: {message}", err=True)
    if exc.status == 401:
        say("  (check your token: gpuctl login, or GPUCTL_TOKEN)", err=True)


def _handle_errors(fn):
    """Turn the client's exceptions into a message on stderr and the documented exit status."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ApiError as exc:
            _print_api_error(exc)
            code = exc.exit_code
        except ConnectionFailed as exc:
            say(f"error: {exc}", err=True)
            code = exc.exit_code
        except config.ConfigError as exc:
            say(f"error: {exc}", err=True)
            code = 3  # like a 401: no usable credentials
        except SpecError as exc:
            say(f"error: {exc}", err=True)
            code = 2  # like a 400
        finally:
            while _opened:
                _opened.pop().close()  # its keep-alive connection
        # Raised outside the handler, so the exit does not carry the error's traceback (and the
        # response and connection it references) along with it.
        raise typer.Exit(code)

    return wrapper


def command(name: str | None = None, **kwargs):
    return lambda fn: app.command(name, **kwargs)(_handle_errors(fn))


def _open(url: str, token: str) -> Client:
    client = Client(url, token)
    _opened.append(client)
    return client


def _client() -> Client:
    creds = config.load()
    return _open(creds.url, creds.token)


class _Poller:
    """Waits between polls until an optional deadline; rides out a few transient failures
    (the portal restarting, a proxy's 502, a throttle) instead of ending a long watch."""

    MAX_FAILURES = 5

    def __init__(self, interval: float, timeout: float | None):
        self.interval = interval
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def wait(self) -> None:
        pause = self.interval
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise _GaveUp()
            pause = min(pause, left)
        time.sleep(pause)

    def call(self, fetch):
        failures = 0
        while True:
            try:
                return fetch()
            except (ApiError, ConnectionFailed) as exc:
                if not exc.transient or failures >= self.MAX_FAILURES:
                    raise
                failures += 1
                say(f"warning: {exc}; retrying", err=True)
                self.wait()


def _watch(client: Client, job: dict, *, interval: float, timeout: float | None, json_output: bool) -> dict:
    """Poll GET jobs/ID/ until the job is terminal; print a line whenever what it does or why it
    waits changes (to stderr with -o json). Returns the final job."""
    poller, last = _Poller(interval, timeout), None
    job_id = job["id"]
    try:
        while True:
            line = f"{job['state']:<10} {job_note(job)}".rstrip()
            if line != last:
                say(f"{time.strftime('%H:%M:%S')}  job {job_id}  {line}", err=json_output)
                last = line
            if job["state"] in TERMINAL:
                return job
            poller.wait()
            job = poller.call(lambda: client.job(job_id))
    except (_GaveUp, KeyboardInterrupt) as exc:
        gave_up = isinstance(exc, _GaveUp)
        what = f"gave up after {timeout:g} s" if gave_up else "\nstopped watching"
        say(f"{what}: job {job_id} is still {job['state']} and goes on (gpuctl cancel {job_id} stops it)",
            err=True)
        if json_output:
            emit_json(job)  # -o json: still one document, the job as last seen
        raise typer.Exit(1 if gave_up else 130) from None


def _print_next_steps(job: dict) -> None:
    job_id = job["id"]
    say(f"  watch:   gpuctl show {job_id} --watch")
    say(f"  logs:    gpuctl logs -f {job_id}")
    say(f"  cancel:  gpuctl cancel {job_id}")


def _finish_submit(client: Client, job: dict, *, verb: str, created: bool, watch: bool, interval: float,
                   timeout: float | None, output: Format) -> None:
    if output is Format.table:
        what = f"job {job['id']}"
        if job.get("is_array_parent"):
            what = f"array job {job['id']} ({sum((job.get('tasks') or {}).values())} tasks)"
        say(f"{verb} {what} \"{job['name']}\" in {job['project']}: {job['state']}")
        if not created:
            say("  (this idempotency key was already used: that job is shown, nothing new was submitted)")
        _print_next_steps(job)
    if not watch:
        if output is Format.json:
            emit_json(job)
        return
    job = _watch(client, job, interval=interval, timeout=timeout, json_output=output is Format.json)
    if output is Format.json:
        emit_json(job)
    raise typer.Exit(0 if job["state"] == "succeeded" else 1)


# Spec building: a file, then the flags over it.

def _read_spec_file(path: str) -> dict:
    name = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {name}: {exc.strerror}") from None
    import yaml  # only for a YAML spec: a start-up cost every other command would pay

    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise SpecError(f"{name} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"{name}: expected a mapping of spec fields (project, name, image, command, ...)")
    if isinstance(data.get("command"), str):
        try:
            data["command"] = shlex.split(data["command"])
        except ValueError as exc:  # unbalanced quotes
            raise SpecError(f"{name}: command: {exc}") from None
    if isinstance(data.get("env"), dict):
        # YAML reads `SEED: 1` as a number; the API takes strings only.
        data["env"] = {k: _env_value(v) for k, v in data["env"].items()}
    return data


def _env_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (int, float)) else value  # anything else: the API names the field


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            # Like `docker run -e NAME`: pass the variable from this shell.
            if name not in os.environ:
                raise SpecError(f"--env {name}: use NAME=VALUE, or export {name} first")
            value = os.environ[name]
        env[name] = value
    return env


def _parse_ids(items: list[str], flag: str) -> list[int]:
    ids = []
    for item in items:
        for part in filter(None, item.split(",")):
            if not part.strip().isdigit():
                raise SpecError(f"{flag} {item}: expected job ids like 12 or 12,13")
            ids.append(int(part))
    return ids


def _num(value: float | None):
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value


def build_spec(file: str | None, flags: dict, resources: dict, env: list[str], depends_on: list[str],
               command: list[str]) -> dict:
    """The spec to POST: the file's fields, then every flag given over them."""
    spec = _read_spec_file(file) if file else {}
    spec.update({k: v for k, v in flags.items() if v is not None})
    resources = {k: v for k, v in resources.items() if v is not None}
    if resources:
        base = spec.get("resources") if isinstance(spec.get("resources"), dict) else {}
        spec["resources"] = {**base, **resources}
    if env:
        base = spec.get("env") if isinstance(spec.get("env"), dict) else {}
        spec["env"] = {**base, **_parse_env(env)}
    if depends_on:
        spec["depends_on"] = _parse_ids(depends_on, "--depends-on")
    if command:
        spec["command"] = list(command)
    if "name" not in spec and "template" not in spec and isinstance(spec.get("command"), list) and spec["command"]:
        spec["name"] = os.path.basename(str(spec["command"][0]))[:200] or "job"
    return spec


# The commands.

@app.callback(invoke_without_command=True)
def _root(show_version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False):
    if show_version:
        say(f"gpuctl {version()}")
        raise typer.Exit(0)


@command()
def login(
    url: Annotated[str | None, typer.Option(help="The portal, e.g. https://portal.example.com.")] = None,
    token: Annotated[str | None, typer.Option(help="A personal API token (gpp_...); '-' reads it from stdin. "
                                                   "Prompted for (hidden) when left out.")] = None,
):
    """Check a token against the portal (GET /api/v1/me/) and save URL and token (mode 0600)."""
    try:
        saved = config.read_file()
    except config.ConfigError:
        saved = {}  # about to be replaced
    url = url or typer.prompt("Portal URL", default=saved.get("url") or None)
    if token == "-":
        token = sys.stdin.readline()
    token = (token or typer.prompt("API token (gpp_...)", hide_input=True)).strip()
    client = _open(url, token)
    me = client.me()
    path = config.save(url=client.base_url, token=token)
    info = me.get("token") or {}
    scopes = ", ".join(info.get("scopes") or [])
    say(f"Logged in to {client.base_url} as {me['username']}"
        + (f" (token {info.get('prefix')}…, scopes: {scopes})" if info else ""))
    say(f"Saved to {path} (readable by you only).")
    if config.overridden_by_env():
        say(f"note: {' and '.join(config.overridden_by_env())} in your environment override this file.", err=True)


@command()
def whoami(output: OutputOpt = Format.table):
    """Who the token belongs to, its scopes, and your projects."""
    client = _client()
    me = client.me()
    if output is Format.json:
        return emit_json(me)
    say(f"{me['username']} at {client.base_url}" + (" (staff)" if me.get("is_staff") else ""))
    token = me.get("token")
    if token:
        say(f"  token:    {token['prefix']}…  scopes: {', '.join(token['scopes'])}"
            + (f"  project: {token['project']}" if token.get("project") else "")
            + (f"  expires: {token['expires_at'][:10]}" if token.get("expires_at") else ""))
    for m in me.get("memberships") or []:
        say(f"  project:  {m['project']} ({m['organization']}), {m['role']}")


@command()
def submit(
    command: Annotated[list[str] | None, typer.Argument(
        metavar="COMMAND", help="The command to run, after --.", show_default=False)] = None,
    file: Annotated[str | None, typer.Option(
        "--file", "-f", metavar="SPEC",
        help="A spec in YAML or JSON ('-': stdin); flags override its fields.")] = None,
    project: Annotated[str | None, typer.Option("--project", "-p", help="Project slug.")] = None,
    name: Annotated[str | None, typer.Option(help="Job name (default: the command's program).")] = None,
    image: Annotated[str | None, typer.Option(help="Container image, e.g. gpuportal/python:3.11.")] = None,
    gpus: Annotated[float | None, typer.Option(help="GPUs: 1, 2, ... or a shared 0.125/0.25/0.5.")] = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes to span (default 1: all GPUs on one node); above 1 "
                                                   "the job runs as one gang.")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs on each node of a multi-node job.")] = None,
    gpu_type: Annotated[str | None, typer.Option(help="GPU model, e.g. H100-80GB.")] = None,
    cpus: Annotated[float | None, typer.Option(help="CPU cores.")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="Memory in MB.")] = None,
    time_limit: Annotated[str | None, typer.Option(help="Seconds, 90m, 2h, 1d or D-HH:MM:SS.")] = None,
    priority: Annotated[str | None, typer.Option(help="low, normal or high.")] = None,
    preemptible: Annotated[bool | None, typer.Option("--preemptible/--no-preemptible",
                                                     help="May be stopped for higher-priority work.",
                                                     show_default=False)] = None,
    network: Annotated[bool | None, typer.Option("--network/--no-network", help="Network access.",
                                                 show_default=False)] = None,
    array: Annotated[str | None, typer.Option(help="Array indexes: 0-99, 1,3,5, with %N to run N at once.")] = None,
    depends_on: Annotated[list[str] | None, typer.Option(
        metavar="ID", help="Start after job ID succeeds (repeatable).")] = None,
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", metavar="NAME=VALUE", help="An environment variable (repeatable).")] = None,
    template: Annotated[str | None, typer.Option(help="Start from the project's job template.")] = None,
    dataset: Annotated[list[str] | None, typer.Option(
        "--dataset", "-d", metavar="NAME[@VERSION]", help="Read a dataset at /datasets/NAME (repeatable; without "
                                                           "@VERSION its latest ready version).")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="Retry-safe: a second submit with the same key "
                                                             "returns the first job.")] = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    timeout: TimeoutOpt = None,
    output: OutputOpt = Format.table,
):
    """Submit a job: gpuctl submit -p vision --image IMG --gpus 2 -- python train.py"""
    flags = {"project": project, "name": name, "image": image, "time_limit": time_limit, "priority": priority,
             "preemptible": preemptible, "network": network, "array": array, "template": template}
    spec = build_spec(file, flags, {"gpus": _num(gpus), "nodes": nodes, "gpus_per_node": gpus_per_node,
                                    "gpu_type": gpu_type, "cpus": _num(cpus),
                                    "memory_mb": memory_mb}, env or [], depends_on or [], command or [])
    if dataset:
        spec["datasets"] = list(dataset)
    client = _client()
    job, created = client.submit(spec, idempotency_key=idempotency_key)
    _finish_submit(client, job, verb="Submitted", created=created, watch=watch, interval=interval, timeout=timeout,
                   output=output)


@command("list")
def list_jobs(
    active: Annotated[bool, typer.Option("--active", "-a", help="Only jobs that have not ended.")] = False,
    project: Annotated[str | None, typer.Option("--project", "-p", help="Only this project.")] = None,
    state: Annotated[str | None, typer.Option(help="Only these states, e.g. queued,running.")] = None,
    mine: Annotated[bool, typer.Option("--mine", help="Only jobs you submitted.")] = False,
    tasks: Annotated[bool, typer.Option("--tasks", help="Also list the tasks of array jobs.")] = False,
    limit: Annotated[int, typer.Option(min=1, max=500, help="At most this many, newest first.")] = 20,
    output: OutputOpt = Format.table,
):
    """Jobs you may see, newest first."""
    client = _client()
    filters = {"project": project, "state": state, "active": "true" if active else None,
               "user": client.me()["username"] if mine else None, "tasks": None if tasks else "false"}
    jobs, count = client.jobs(limit=limit, **filters)
    if output is Format.json:
        return emit_json(jobs)
    say(job_table(jobs) if jobs else "No jobs.")
    if count > len(jobs):
        say(f"({len(jobs)} of {count} shown; --limit N for more)", err=True)


@command()
def shell(job_ref: JobRefArg):
    """A shell in a running job (its environment, its GPUs), like srun --pty --jobid: through the
    portal to the job's terminal session (ports: [{name: sh, kind: terminal}], docs/sessions.md)."""
    client = _client()
    job_id = client.resolve(job_ref)
    creds = config.load()
    try:
        session = find_session(client, job_id, kind="terminal")
        client.close()
        raise typer.Exit(shell_run(client.base_url, creds.token, session))
    except SessionError as exc:
        say(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@command("port-forward")
def port_forward(
    job_ref: JobRefArg,
    ports: Annotated[str, typer.Argument(metavar="LOCAL:REMOTE",
                                         help="A local port and a port the job publishes (or its session's name).")],
):
    """Forward 127.0.0.1:LOCAL to a port the job publishes, through the portal (like kubectl
    port-forward). Ctrl-C stops it."""
    local, sep, remote = ports.partition(":")
    if not sep or not local.isdigit() or not remote:
        say("error: expected LOCAL:REMOTE, e.g. 8888:8888 or 6006:tb", err=True)
        raise typer.Exit(2)
    client = _client()
    job_id = client.resolve(job_ref)
    creds = config.load()
    try:
        session = find_session(client, job_id, port=int(remote) if remote.isdigit() else None,
                               name=None if remote.isdigit() else remote)
        client.close()
        forward(client.base_url, creds.token, session, int(local),
                ready=lambda p: say(f"Forwarding 127.0.0.1:{p} -> job {job_id} {session['name']}; Ctrl-C stops"))
    except SessionError as exc:
        say(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@command()
def share(
    job_ref: JobRefArg,
    name: Annotated[str, typer.Argument(help="The session's name (its port's name in the job's spec).")],
    project: Annotated[bool | None, typer.Option("--project/--owner",
                                                 help="Let every member of the job's project in, or only you "
                                                      "(and the people named).")] = None,
    users: Annotated[list[str] | None, typer.Option("--user", "-u", help="A person of the job's organization "
                                                    "to let in by name (repeat it); replaces the list.")] = None,
    no_users: Annotated[bool, typer.Option("--no-users", help="Take every name back.")] = False,
    output: OutputOpt = Format.table,
):
    """Who may connect to a job's session besides you (docs/sessions.md): its project, people by name.
    Without options, says who may."""
    client = _client()
    job_id = client.resolve(job_ref)
    sessions = client.get("sessions/", what=f"job {job_id}", job=job_id).get("results", [])
    session = next((s for s in sessions if s["name"] == name), None)
    if session is None:
        say(f"error: job {job_id} publishes no session {name!r}; its sessions: "
            + (", ".join(s["name"] for s in sessions) or "none") + ".", err=True)
        raise typer.Exit(1)
    body: dict = {}
    if project is not None:
        body["share"] = "project" if project else "owner"
    if users or no_users:
        body["users"] = [] if no_users else list(users)
    if body:
        session = client.request("PATCH", f"sessions/{session['id']}/", body=body,
                                 what=f"session {name} of job {job_id}")
    if output is Format.json:
        return emit_json(session)
    who = ["the job's project" if session["share"] == "project" else "its owner"] + session.get("users", [])
    say(f"Session {name} of job {job_id}: {', '.join(who)}.")


@command()
def show(
    job_ref: JobRefArg,
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    timeout: TimeoutOpt = None,
    output: OutputOpt = Format.table,
):
    """A job: its state, why it waits (and its place in the queue), and its timeline."""
    client = _client()
    job_id = client.resolve(job_ref)
    job = client.job(job_id)
    if watch:
        job = _watch(client, job, interval=interval, timeout=timeout, json_output=output is Format.json)
        job = client.job(job_id)  # the final timeline
    if output is Format.json:
        emit_json(job)
    else:
        say(job_detail(job))
    if watch:
        raise typer.Exit(0 if job["state"] == "succeeded" else 1)


def _write(text: str) -> None:
    # Not typer.echo: it strips colour codes the job printed when stdout is not a terminal.
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


@command()
def logs(
    job_ref: JobRefArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job has ended "
                                                                "and its log is complete.")] = False,
    attempt: Annotated[int | None, typer.Option(min=1, help="An earlier attempt (default: the latest).")] = None,
    interval: IntervalOpt = 1.0,
    timeout: TimeoutOpt = None,
    output: OutputOpt = Format.table,
):
    """Print a job's log (GET jobs/ID/logs/?offset=N); -f follows it like tail -f."""
    if follow and output is Format.json:
        raise SpecError("-f streams text; use -o json without -f for one JSON document")
    client = _client()
    job_id = client.resolve(job_ref)
    if not follow:
        doc = client.logs(job_id, attempt=attempt)
        if output is Format.json:
            return emit_json(doc)  # one page: `next_offset` < `size` says more follows
        _write(doc["data"])
        while doc["offset"] < doc["next_offset"] < doc["size"]:  # the log comes in pages of at most 1 MiB
            doc = client.logs(job_id, offset=doc["next_offset"], attempt=doc["attempt"])
            _write(doc["data"])
        return None
    poller, offset, current = _Poller(interval, timeout), 0, attempt
    try:
        while True:
            doc = poller.call(lambda: client.logs(job_id, offset=offset, attempt=attempt))
            if current is not None and doc["attempt"] != current:
                # Preempted and requeued: the new attempt's log starts again at 0.
                say(f"--- job {job_id}: attempt {doc['attempt']} ---", err=True)
                current, offset = doc["attempt"], 0
                continue
            current = doc["attempt"]
            _write(doc["data"])
            offset = doc["next_offset"]
            if offset < doc.get("size", offset):
                continue  # more is stored already: read the next page now
            if doc["complete"]:
                if not doc["data"]:
                    break
                continue  # ended: read until a read returns nothing, so the tail is not cut off
            poller.wait()
    except _GaveUp:
        say(f"gave up after {timeout:g} s; job {job_id} has not ended", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    job = client.job(job_id)
    say(f"--- job {job_id} {job['state']}: {job_note(job) or 'ended'} ---", err=True)


@command()
def cancel(job_ids: JobRefsArg, output: OutputOpt = Format.table):
    """Cancel jobs (an array job: all its unfinished tasks). Running jobs are stopped on their node."""
    _each_job(job_ids, lambda client, job_id: client.cancel(job_id), output)


def _each_job(job_ids: list[str], act, output: Format) -> None:
    """Run `act(client, id)` on every job; report each, and exit with the first failure's status."""
    client, done, failed = _client(), [], None
    for ref in job_ids:
        try:
            job = act(client, client.resolve(ref))
        except ApiError as exc:
            _print_api_error(exc)
            failed = failed or exc
            continue
        done.append(job)
        if output is Format.table:
            say(f"job {ref}: {job['state']}" + (f" ({job_note(job)})" if job_note(job) else ""))
    if output is Format.json:
        emit_json(done)
    if failed:
        raise typer.Exit(failed.exit_code)


@command()
def move(job_ids: JobRefsArg, output: OutputOpt = Format.table):
    """Operators: move running jobs to other GPUs. Each is requeued as its next attempt; a job that
    checkpoints gets its signal and grace to save first and resumes from its checkpoint."""
    _each_job(job_ids, lambda client, job_id: client.move(job_id), output)


@command()
def hold(job_ids: JobRefsArg, output: OutputOpt = Format.table):
    """Hold queued jobs (like scontrol hold): they stay queued and are not started until released."""
    _each_job(job_ids, lambda client, job_id: client.hold(job_id), output)


@command()
def release(job_ids: JobRefsArg, output: OutputOpt = Format.table):
    """Release held jobs (like scontrol release): they queue again by their submit time."""
    _each_job(job_ids, lambda client, job_id: client.release(job_id), output)


@command()
def update(
    job_ids: JobRefsArg,
    time_limit: Annotated[str | None, typer.Option("--time-limit", "-t", help="New time limit: seconds, "
                                                   "'90m', '2h' or '1-00:00:00' (raising it takes the "
                                                   "project's owner or admin role).")] = None,
    priority: Annotated[str | None, typer.Option(help="low, normal or high (raising it takes the owner or "
                                                      "admin role).")] = None,
    gpus: Annotated[float | None, typer.Option(min=0, help="New GPU count, within the project's limit.")] = None,
    output: OutputOpt = Format.table,
):
    """Change queued jobs (like scontrol update): time limit, priority, GPU count."""
    changes: dict = {}
    if time_limit is not None:
        changes["time_limit"] = time_limit
    if priority is not None:
        changes["priority"] = priority
    if gpus is not None:
        changes["resources"] = {"gpus": _num(gpus)}
    if not changes:
        raise SpecError("give --time-limit, --priority or --gpus")
    _each_job(job_ids, lambda client, job_id: client.update(job_id, changes), output)


@command()
def resubmit(
    job_id: Annotated[int, typer.Argument(metavar="ID")],
    watch: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    timeout: TimeoutOpt = None,
    output: OutputOpt = Format.table,
):
    """Submit a job again with the same spec (the original stays as it ended)."""
    client = _client()
    job = client.resubmit(job_id)
    _finish_submit(client, job, verb=f"Resubmitted job {job_id} as", created=True, watch=watch, interval=interval,
                   timeout=timeout, output=output)


class UsageBy(str, Enum):
    job = "job"
    project = "project"
    user = "user"
    organization = "organization"
    day = "day"
    gpu_model = "gpu_model"


@command()
def usage(
    job_ids: Annotated[list[str] | None, typer.Argument(metavar="[ID...]", help="Jobs to report on, like "
                                                        "seff (array tasks as 3_0).")] = None,
    since: Annotated[str | None, typer.Option("--since", "-S", help="From this date or ISO time (UTC), "
                                                                   "inclusive; default: the 1st of this month.")] = None,
    until: Annotated[str | None, typer.Option("--until", "-E", help="To this date or time, exclusive.")] = None,
    by: Annotated[UsageBy, typer.Option("--by", help="One row per job (default), or sums per project, user, "
                                                     "organization, day or GPU model.")] = UsageBy.job,
    project: Annotated[str | None, typer.Option("--project", "-p", help="Only this project.")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's jobs (--by job).")] = None,
    mine: Annotated[bool, typer.Option("--mine", help="Only your jobs (--by job).")] = False,
    limit: Annotated[int, typer.Option(min=1, max=500, help="At most this many jobs, newest first.")] = 50,
    output: OutputOpt = Format.table,
):
    """Accounting like sacct and seff: GPU-hours, GPU efficiency and cost per job, or sums per
    project or user over a range."""
    client = _client()
    if job_ids:
        ids = ",".join(str(client.resolve(ref)) for ref in job_ids)
        doc = client.job_usage(job=ids, limit=len(job_ids))
        if output is Format.json:
            return emit_json(doc)
        if not doc["results"]:
            raise ApiError(404, "not_found", "No GPU time recorded for these jobs (not started yet?).")
        return say("\n\n".join(job_efficiency(row) for row in doc["results"]))
    if since is None:
        since = time.strftime("%Y-%m-01", time.gmtime())
    if by is UsageBy.job:
        who = client.me()["username"] if mine else user
        doc = client.job_usage(**{"from": since, "to": until, "project": project, "user": who, "limit": limit})
        return emit_json(doc) if output is Format.json else say(job_usage_table(doc))
    if user or mine:
        raise SpecError("--user and --mine select jobs; with --by project|user|... use --project")
    doc = client.usage(**{"from": since, "to": until, "project": project, "group_by": by.value})
    return emit_json(doc) if output is Format.json else say(usage_group_table(doc))


@command()
def nodes(output: OutputOpt = Format.table):
    """The cluster's GPUs by pool and type, used, free and unavailable (like sinfo); counts only."""
    cluster = _client().cluster()
    if output is Format.json:
        return emit_json(cluster)
    say(cluster_tables(cluster))


@command()
def quota(
    project: Annotated[str | None, typer.Option("--project", "-p", help="One project, in detail.")] = None,
    output: OutputOpt = Format.table,
):
    """Your projects' quotas: guaranteed and maximum GPUs, running jobs, time limit, budget."""
    client = _client()
    if project:
        data = client.project(project)
        return emit_json(data) if output is Format.json else say(project_detail(data))
    projects = client.projects()
    if output is Format.json:
        return emit_json(projects)
    say(project_table(projects) if projects else "You are in no project yet.")


volumes_app = typer.Typer(help="Project volumes: persistent folders jobs see at /data/<name> (docs/storage.md).",
                          no_args_is_help=True)
app.add_typer(volumes_app, name="volumes")
VolumeArg = Annotated[int, typer.Argument(metavar="VOLUME_ID", help="The volume's id (gpuctl volumes list).")]


def volumes_command(name: str):
    return lambda fn: volumes_app.command(name)(_handle_errors(fn))


@volumes_command("create")
def volumes_create(
    project: Annotated[str, typer.Argument(help="The project.")],
    name: Annotated[str, typer.Argument(help="The volume's name (lowercase letters, digits, hyphens).")],
    quota_mb: Annotated[int | None, typer.Option("--quota-mb", min=1, help="Size quota for uploads.")] = None,
    output: OutputOpt = Format.table,
):
    """Create a volume in a project (owners and admins)."""
    body = {"project": project, "name": name, **({"quota_mb": quota_mb} if quota_mb else {})}
    volume = _client().volume_create(body)
    if output is Format.json:
        return emit_json(volume)
    say(f"Created volume {volume['id']} ({project}/{name}); jobs mount it with "
        f"\"volumes\": [{{\"name\": \"{name}\"}}] at {volume['mount_path']}.")


@volumes_command("list")
def volumes_list(
    project: Annotated[str | None, typer.Option("--project", "-p", help="Only this project's.")] = None,
    output: OutputOpt = Format.table,
):
    """The volumes of your projects."""
    rows = _client().volumes(project)
    if output is Format.json:
        return emit_json(rows)
    say(table([[v["id"], v["project"], v["name"], v["quota_mb"], v["mount_path"]] for v in rows],
              ["ID", "PROJECT", "NAME", "QUOTA_MB", "MOUNT"]) if rows else "No volumes.")


@volumes_command("ls")
def volumes_ls(volume_id: VolumeArg, path: Annotated[str, typer.Argument(help="A folder in the volume.")] = "",
               output: OutputOpt = Format.table):
    """List a folder of a volume."""
    listing = _client().volume_files(volume_id, path)
    if output is Format.json:
        return emit_json(listing)
    say(table([[e["type"], "" if e["size"] is None else e["size"], e["name"]] for e in listing["entries"]],
              ["TYPE", "SIZE", "NAME"]) if listing["entries"] else "(empty)")


@volumes_command("put")
def volumes_put(volume_id: VolumeArg, source: Annotated[Path, typer.Argument(help="A local file.")],
                path: Annotated[str, typer.Argument(help="Where in the volume.")], output: OutputOpt = Format.table):
    """Upload a file into a volume (members)."""
    try:
        with open(source, "rb") as handle:
            done = _client().volume_put(volume_id, path, handle)
    except OSError as exc:
        raise SpecError(f"{source}: {exc.strerror}") from None
    return emit_json(done) if output is Format.json else say(f"Uploaded {done['size']} bytes to {done['path']}.")


@volumes_command("get")
def volumes_get(volume_id: VolumeArg, path: Annotated[str, typer.Argument(help="A file in the volume.")],
                dest: Annotated[Path | None, typer.Option("--output-file", "-O",
                                                          help="Where to write it (default: its name here).")] = None):
    """Download a file from a volume."""
    target = dest or Path(path.rstrip("/").rsplit("/", 1)[-1] or "download")
    client = _client()
    size = _download(target, lambda handle: client.volume_get(volume_id, path, handle))
    say(f"Wrote {size} bytes to {target}.", err=True)


def _download(target: Path, fetch) -> int:
    """Write what `fetch(handle)` streams to `target` through a `.part` file, renamed only when whole;
    returns the byte count."""
    partial = target.with_name(target.name + ".part")
    try:
        with open(partial, "wb") as handle:
            size = fetch(handle)
        partial.replace(target)
    except OSError as exc:
        raise SpecError(f"{target}: {exc.strerror}") from None
    finally:
        partial.unlink(missing_ok=True)
    return size


datasets_app = typer.Typer(help="Datasets: named, versioned, read-only inputs jobs read at /datasets/<name>, "
                                "cached on each node (docs/storage.md).", no_args_is_help=True)
app.add_typer(datasets_app, name="datasets")
DatasetArg = Annotated[int, typer.Argument(metavar="DATASET_ID", help="The dataset's id (gpuctl datasets list).")]
UrlOpt = Annotated[str | None, typer.Option("--url", help="An http(s) URL of one file (a .tar, .tar.gz... is "
                                                         "unpacked on the node).")]
S3BucketOpt = Annotated[str | None, typer.Option("--s3-bucket", help="An S3-compatible bucket.")]
S3PrefixOpt = Annotated[str, typer.Option("--s3-prefix", help="Every object below this key prefix.")]
S3EndpointOpt = Annotated[str, typer.Option("--s3-endpoint", help="The S3-compatible endpoint (default AWS).")]
S3KeyOpt = Annotated[str, typer.Option("--s3-access-key", help="The bucket's access key (the secret comes from "
                                                                "GPUCTL_S3_SECRET_KEY).")]


def datasets_command(name: str):
    return lambda fn: datasets_app.command(name)(_handle_errors(fn))


def _dataset_source(url, bucket, prefix, endpoint, access_key) -> dict | None:
    if url and bucket:
        raise SpecError("Give --url or --s3-bucket, not both.")
    if url:
        return {"kind": "http", "url": url}
    if bucket:
        source = {"kind": "s3", "bucket": bucket, "prefix": prefix}
        if endpoint:
            source["endpoint_url"] = endpoint
        if access_key:
            source.update(access_key=access_key, secret_key=os.environ.get("GPUCTL_S3_SECRET_KEY", ""))
        return source
    return None


def _version_rows(dataset: dict) -> list[list]:
    return [[v["version"], v["state"], "" if v["size"] is None else v["size"], (v["digest"] or "")[:12],
             v["location"], v["message"]] for v in dataset["versions"]]


@datasets_command("create")
def datasets_create(
    project: Annotated[str, typer.Argument(help="The project.")],
    name: Annotated[str, typer.Argument(help="The dataset's name (lower-case letters, digits, '.', '_', '-').")],
    url: UrlOpt = None, s3_bucket: S3BucketOpt = None, s3_prefix: S3PrefixOpt = "", s3_endpoint: S3EndpointOpt = "",
    s3_access_key: S3KeyOpt = "",
    description: Annotated[str, typer.Option(help="What it holds.")] = "",
    output: OutputOpt = Format.table,
):
    """Create a dataset, with version 1 from a URL or a bucket prefix when given (members)."""
    body = {"project": project, "name": name, "description": description}
    source = _dataset_source(url, s3_bucket, s3_prefix, s3_endpoint, s3_access_key)
    if source:
        body["source"] = source
    dataset = _client().dataset_create(body)
    if output is Format.json:
        return emit_json(dataset)
    say(f"Created dataset {dataset['id']} ({project}/{name})" + (
        "; version 1 is read by the portal (gpuctl datasets show)" if source else "") +
        f". Jobs name it with \"datasets\": [\"{name}\"] and read it at {dataset['mount_path']}.")


@datasets_command("list")
def datasets_list(
    project: Annotated[str | None, typer.Option("--project", "-p", help="Only this project's.")] = None,
    output: OutputOpt = Format.table,
):
    """The datasets of your projects."""
    rows = _client().datasets(project)
    if output is Format.json:
        return emit_json(rows)
    say(table([[d["id"], d["project"], d["name"], "" if d["latest"] is None else d["latest"], len(d["versions"]),
                d["mount_path"]] for d in rows], ["ID", "PROJECT", "NAME", "LATEST", "VERSIONS", "MOUNT"])
        if rows else "No datasets.")


@datasets_command("show")
def datasets_show(dataset_id: DatasetArg, output: OutputOpt = Format.table):
    """A dataset and its versions (state, size, digest, source)."""
    dataset = _client().dataset(dataset_id)
    if output is Format.json:
        return emit_json(dataset)
    say(f"{dataset['project']}/{dataset['name']}  at {dataset['mount_path']}  {dataset['description']}".rstrip())
    say(table(_version_rows(dataset), ["VERSION", "STATE", "SIZE", "DIGEST", "SOURCE", "MESSAGE"])
        if dataset["versions"] else "No versions yet.")


@datasets_command("add-version")
def datasets_add_version(dataset_id: DatasetArg, url: UrlOpt = None, s3_bucket: S3BucketOpt = None,
                         s3_prefix: S3PrefixOpt = "", s3_endpoint: S3EndpointOpt = "", s3_access_key: S3KeyOpt = "",
                         output: OutputOpt = Format.table):
    """Add the next version from a URL or a bucket prefix (versions never change)."""
    source = _dataset_source(url, s3_bucket, s3_prefix, s3_endpoint, s3_access_key)
    if source is None:
        raise SpecError("Give --url or --s3-bucket (or upload a file with gpuctl datasets upload).")
    version = _client().dataset_version(dataset_id, source)
    return emit_json(version) if output is Format.json else say(
        f"Version {version['version']} is {version['state']}: the portal reads its files, size and digest.")


@datasets_command("upload")
def datasets_upload(dataset_id: DatasetArg, source: Annotated[Path, typer.Argument(help="A local file (a .tar, "
                                                                                       ".tar.gz... is unpacked).")],
                    output: OutputOpt = Format.table):
    """Add the next version from a local file."""
    try:
        with open(source, "rb") as handle:
            version = _client().dataset_upload(dataset_id, source.name, handle)
    except OSError as exc:
        raise SpecError(f"{source}: {exc.strerror}") from None
    return emit_json(version) if output is Format.json else say(
        f"Version {version['version']}: {version['size']} bytes, digest {version['digest'][:12]}.")


artifacts_app = typer.Typer(help="Job artifacts: what a job left in /outputs, uploaded when it ended (docs/storage.md).",
                            no_args_is_help=True)
app.add_typer(artifacts_app, name="artifacts")


def artifacts_command(name: str):
    return lambda fn: artifacts_app.command(name)(_handle_errors(fn))


AttemptOpt = Annotated[int | None, typer.Option("--attempt", min=1, help="This attempt's (default: every attempt "
                                                                          "for list, the last one with artifacts for get).")]


@artifacts_command("list")
def artifacts_list(job_ref: JobRefArg, attempt: AttemptOpt = None, output: OutputOpt = Format.table):
    """The files a job's attempts left in /outputs."""
    client = _client()
    rows = client.artifacts(client.resolve(job_ref), attempt)
    if output is Format.json:
        return emit_json(rows)
    say(table([[a["attempt"], a["size"], a["path"]] for a in rows], ["ATTEMPT", "SIZE", "PATH"])
        if rows else "No artifacts (the job has not ended, or left nothing in /outputs).")


@artifacts_command("get")
def artifacts_get(
    job_ref: JobRefArg,
    paths: Annotated[list[str] | None, typer.Argument(help="Only these files (default: all).")] = None,
    attempt: AttemptOpt = None,
    dest: Annotated[Path | None, typer.Option("--dir", "-d", help="Where to put them (default: ./job-<id>).")] = None,
):
    """Download a job's artifacts into a folder, keeping their paths."""
    client = _client()
    job_id = client.resolve(job_ref)
    rows = client.artifacts(job_id, attempt)
    if attempt is None and rows:
        last = max(a["attempt"] for a in rows)
        rows = [a for a in rows if a["attempt"] == last]
    if paths:
        missing = sorted(set(paths) - {a["path"] for a in rows})
        if missing:
            raise SpecError(f"job {job_id} has no artifact {missing[0]!r}" +
                            (f" in attempt {rows[0]['attempt']}" if rows else ""))
        rows = [a for a in rows if a["path"] in paths]
    if not rows:
        raise SpecError(f"job {job_id} has no artifacts (it has not ended, or left nothing in /outputs).")
    folder = (dest or Path(f"job-{job_id}")).resolve()
    total = 0
    for a in rows:
        target = (folder / a["path"]).resolve()
        if folder not in target.parents:  # the portal never sends such a path; never write outside all the same
            raise SpecError(f"refusing the artifact path {a['path']!r}: it leads outside {folder}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpecError(f"{target}: {exc.strerror}") from None
        total += _download(target, lambda handle, aid=a["id"]: client.artifact_get(job_id, aid, handle))
    say(f"Wrote {len(rows)} file(s), {total} bytes, to {folder}.", err=True)


def only_the_invoked_command(argv: list[str]) -> typer.Typer:
    """The app with only the command (or command group) argv names, else the whole app.

    typer builds every command's parameters from its signature before it parses anything, about
    7 ms of CPU for gpuctl's 30 commands; a `gpuctl submit` needs one. A name gpuctl does not know,
    an option first (--help, --version) or shell completion gets the whole app, so its help, its
    "No such command" and its suggestions are unchanged; the named command's own help and errors
    are the same either way (its parent is still `gpuctl`)."""
    name = argv[1] if len(argv) > 1 else ""
    if any(key.startswith("_GPUCTL_COMPLETE") for key in os.environ):
        return app
    commands = [c for c in app.registered_commands
                if (c.name or typer.main.get_command_name(c.callback.__name__)) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if not commands and not groups:
        return app
    pruned = copy.copy(app)
    pruned.registered_commands, pruned.registered_groups = commands, groups
    return pruned


def main() -> None:
    fastparams.defer_help_only_modules()
    only_the_invoked_command(sys.argv)(prog_name="gpuctl")
