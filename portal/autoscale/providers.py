"""Node providers behind one small interface (docs/autoscaling.md, "Providers").

A provider makes machines of a pool's shape exist and go away; it knows nothing of jobs:

- `create(requests) -> {name: provider id or ProviderError}`: start one node per request (its
  name, its agent token, the shape). A node counts as created when its machine exists; it takes
  jobs only once its agent registers, which the autoscaler waits for up to the pool's boot timeout.
- `delete(name, provider_id)`: make it go away (idempotent: a node already gone is not an error).
- `list() -> {name: provider id}`: what exists now, for the console and for reconciling.

Three are built in: `local` (agent processes on this machine with simulated GPUs: the demo and
the tests), `command` (operator scripts, like Slurm's ResumeProgram/SuspendProgram: the way to
drive any cloud API or bare-metal power control) and `libcloud` (a cloud through Apache libcloud).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import threading
from dataclasses import dataclass

from django.conf import settings

from agents.protocol import NODE_SANDBOXES

from . import localnode
from .models import PoolNode, PoolNodeState


class ProviderError(Exception):
    """The provider refused or failed; `unavailable` means out of stock or quota (back off)."""


@dataclass
class NodeRequest:
    name: str
    token: str  # the node's agent token (gpn_...): handed to the machine, never logged
    pool: str
    gpu_model: str
    gpus: int
    sandbox: str

    @property
    def sim_gpus(self) -> str:
        return f"sim:{self.gpus}x{self.gpu_model}"


class Provider:
    def __init__(self, pool):
        self.pool = pool
        self.config = dict(pool.provider_config or {})

    def check(self) -> None:
        """Raise ValueError saying what is wrong with the pool's provider options."""

    def create(self, requests: list[NodeRequest]) -> dict[str, object]:
        raise NotImplementedError

    def delete(self, name: str, provider_id: str = "") -> None:
        raise NotImplementedError

    def list(self) -> dict[str, str]:
        raise NotImplementedError

    def portal_url(self) -> str:
        return str(self.config.get("portal_url") or settings.AUTOSCALE_PORTAL_URL)


class LocalProvider(Provider):
    """Agent processes on this machine (python -m agents) with simulated GPUs of the pool's shape."""

    def check(self) -> None:
        if self.pool.sandbox not in NODE_SANDBOXES:
            raise ValueError(f"sandbox: use one of {', '.join(NODE_SANDBOXES)}")

    def create(self, requests):
        out = {}
        for r in requests:
            try:
                out[r.name] = str(localnode.start(r.name, token=r.token, portal_url=self.portal_url(),
                                                  gpus=r.sim_gpus, sandbox=r.sandbox))
            except OSError as exc:
                out[r.name] = ProviderError(f"could not start the agent: {exc}")
        return out

    def delete(self, name, provider_id=""):
        localnode.stop(name)

    def list(self):
        return {name: str(pid) for name, pid in localnode.running().items()
                if name.startswith(f"{self.pool.name}-")}


def _argv(value) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    return shlex.split(str(value or ""))


class CommandProvider(Provider):
    """Operator programs: `resume_program NAME` once per new node (in parallel), `suspend_program
    NAME PROVIDER_ID` to release one, `list_program POOL` printing one `NAME [ID]` a line. Each runs
    with the node's details in its environment (GPUPORTAL_NODE_NAME, GPUPORTAL_NODE_TOKEN,
    GPUPORTAL_POOL, GPUPORTAL_GPU_MODEL, GPUPORTAL_GPUS_PER_NODE, GPUPORTAL_SIM_GPUS,
    GPUPORTAL_SANDBOX, GPUPORTAL_PORTAL_URL, CELERY_BROKER_URL). The resume program's first line of
    output, if any, is the node's provider id; a non-zero exit fails that node, and exit status 75
    (EX_TEMPFAIL) says the shape is out of stock."""

    def check(self) -> None:
        for key in ("resume_program", "suspend_program"):
            if not _argv(self.config.get(key)):
                raise ValueError(f"{key}: required (a command line or a list of arguments)")

    def _env(self, name: str, token: str = "") -> dict:
        p = self.pool
        return {**os.environ, "GPUPORTAL_NODE_NAME": name, "GPUPORTAL_NODE_TOKEN": token, "GPUPORTAL_POOL": p.name,
                "GPUPORTAL_GPU_MODEL": p.gpu_model, "GPUPORTAL_GPUS_PER_NODE": str(p.gpus_per_node),
                "GPUPORTAL_SIM_GPUS": f"sim:{p.gpus_per_node}x{p.gpu_model}", "GPUPORTAL_SANDBOX": p.sandbox,
                "GPUPORTAL_PORTAL_URL": self.portal_url(), "CELERY_BROKER_URL": settings.CELERY_BROKER_URL}

    def _run(self, argv: list[str], env: dict) -> subprocess.CompletedProcess:
        timeout = float(self.config.get("timeout_s") or 60)
        # Its own session: a program that starts a daemon does not tie it to this worker.
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)

    def create(self, requests):
        out: dict[str, object] = {}

        def one(r: NodeRequest):
            try:
                done = self._run([*_argv(self.config["resume_program"]), r.name], self._env(r.name, r.token))
            except (OSError, subprocess.TimeoutExpired) as exc:
                out[r.name] = ProviderError(f"resume program: {exc}")
                return
            if done.returncode:
                err = ProviderError(f"resume program exited {done.returncode}: "
                                    f"{(done.stderr or done.stdout).strip()[-200:]}")
                err.unavailable = done.returncode == 75
                out[r.name] = err
            else:
                out[r.name] = (done.stdout.strip().splitlines() or [""])[0][:200]

        threads = [threading.Thread(target=one, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def delete(self, name, provider_id=""):
        try:
            done = self._run([*_argv(self.config["suspend_program"]), name, provider_id], self._env(name))
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ProviderError(f"suspend program: {exc}") from exc
        if done.returncode:
            raise ProviderError(f"suspend program exited {done.returncode}: "
                                f"{(done.stderr or done.stdout).strip()[-200:]}")

    def list(self):
        argv = _argv(self.config.get("list_program"))
        if not argv:
            return dict(PoolNode.objects.filter(pool=self.pool, state__in=[
                PoolNodeState.BOOTING, PoolNodeState.READY, PoolNodeState.RELEASING]).values_list("name", "provider_id"))
        done = self._run([*argv, self.pool.name], self._env(""))
        if done.returncode:
            raise ProviderError(f"list program exited {done.returncode}")
        rows = [line.split() for line in done.stdout.splitlines() if line.strip()]
        return {row[0]: (row[1] if len(row) > 1 else "") for row in rows}


_LIBCLOUD_DRIVERS: dict[tuple, object] = {}
_LIBCLOUD_LOCK = threading.Lock()


class LibcloudProvider(Provider):
    """A cloud through Apache libcloud's compute API. Options: `driver` (a libcloud Provider
    constant's value: "ec2", "gce", "azure_arm", "openstack", ... or "dummy"), `key`, `secret` (or
    `secret_env`, the name of an environment variable of the portal's workers holding it),
    `driver_args` (the driver's other arguments, e.g. {"region": "us-east-1"}), `size` and `image`
    (ids from list_sizes/list_images), `location` (optional id), `create_args` (extra keyword
    arguments of create_node, e.g. {"ex_keyname": "ops"}) and `userdata` (a template of the boot
    script: {name}, {token}, {portal_url}, {broker} and {gpus} are filled in; passed as
    ex_userdata, which starts the node's agent). Nodes are named after ours; the driver's node id
    is kept as the provider id."""

    def check(self) -> None:
        # optional (requirements.txt, not the portal extra): loaded by libcloud pools only
        from libcloud.compute.providers import get_driver

        for key in ("driver", "size", "image"):
            if not self.config.get(key):
                raise ValueError(f"{key}: required")
        try:
            get_driver(self.config["driver"])
        except AttributeError as exc:
            raise ValueError(f"driver: libcloud has no compute driver {self.config['driver']!r}") from exc

    def driver(self):
        # optional: see check()
        from libcloud.compute.providers import get_driver

        cfg = self.config
        key = (self.pool.name, cfg["driver"], cfg.get("key"), repr(sorted((cfg.get("driver_args") or {}).items())))
        with _LIBCLOUD_LOCK:  # one client per pool and credentials: connections are reused
            if key not in _LIBCLOUD_DRIVERS:
                cls = get_driver(cfg["driver"])
                args = [cfg["key"]] if cfg.get("key") is not None else []
                # The secret from the worker's environment (`secret_env`) keeps it out of the database.
                secret = cfg.get("secret") or os.environ.get(str(cfg.get("secret_env") or ""), "")
                if secret:
                    args.append(secret)
                _LIBCLOUD_DRIVERS[key] = cls(*args, **(cfg.get("driver_args") or {}))
            return _LIBCLOUD_DRIVERS[key]

    @staticmethod
    def _pick(items, wanted, what):
        for item in items:
            if str(item.id) == str(wanted) or item.name == wanted:
                return item
        raise ProviderError(f"{what} {wanted!r} not offered by the cloud")

    def create(self, requests):
        # optional: see check()
        from libcloud.common.types import LibcloudError

        drv, cfg = self.driver(), self.config
        out: dict[str, object] = {}
        try:
            size = self._pick(drv.list_sizes(), cfg["size"], "size")
            image = self._pick(drv.list_images(), cfg["image"], "image")
        except (LibcloudError, ProviderError, OSError) as exc:
            return {r.name: ProviderError(str(exc)) for r in requests}
        for r in requests:
            kwargs = dict(cfg.get("create_args") or {})
            if cfg.get("location"):
                kwargs["location"] = self._pick(drv.list_locations(), cfg["location"], "location")
            if cfg.get("userdata"):
                kwargs["ex_userdata"] = str(cfg["userdata"]).format(
                    name=r.name, token=r.token, portal_url=self.portal_url(), broker=settings.CELERY_BROKER_URL,
                    gpus=r.sim_gpus if cfg.get("simulated_gpus") else "auto")
            try:
                node = drv.create_node(name=r.name, size=size, image=image, **kwargs)
            except (LibcloudError, OSError, TypeError) as exc:
                err = ProviderError(f"create_node: {exc}")
                # Clouds say "insufficient capacity" / "quota exceeded" for a shape out of stock.
                err.unavailable = any(w in str(exc).lower() for w in ("capacity", "quota", "stock", "limit"))
                out[r.name] = err
                continue
            out[r.name] = str(node.id)
        return out

    def _nodes(self):
        return self.driver().list_nodes()

    def delete(self, name, provider_id=""):
        # optional: see check()
        from libcloud.common.types import LibcloudError

        try:
            for node in self._nodes():
                if (provider_id and str(node.id) == str(provider_id)) or (not provider_id and node.name == name):
                    if not node.destroy():
                        raise ProviderError(f"the cloud refused to destroy {name} ({node.id})")
                    return
        except (LibcloudError, OSError) as exc:
            raise ProviderError(f"destroy_node: {exc}") from exc
        # Not there: already gone, which is what delete wants.

    def list(self):
        known = dict(PoolNode.objects.filter(pool=self.pool).exclude(provider_id="").values_list("provider_id", "name"))
        out = {}
        for node in self._nodes():
            if str(node.id) in known:
                out[known[str(node.id)]] = str(node.id)
            elif node.name.startswith(f"{self.pool.name}-"):
                out[node.name] = str(node.id)
        return out


PROVIDERS = {"local": LocalProvider, "command": CommandProvider, "libcloud": LibcloudProvider}


def provider_for(pool) -> Provider:
    try:
        return PROVIDERS[pool.provider](pool)
    except KeyError:
        raise ValueError(f"provider: unknown {pool.provider!r}; use one of {', '.join(PROVIDERS)}") from None
