"""A node's job images: pulled with the project's registry login, kept in a per-node cache.

``ImageCache.ensure`` makes a job's image present in the Docker engine before its container is
made (docs/storage.md, "Private images"):

- **When it pulls** (the pull policy): an image that is not present is pulled. One that is present
  is used as it is (Kubernetes' IfNotPresent), except an image this cache pulled itself when
  - its tag is ``latest`` (or it names none): pulled again at each launch, as Kubernetes does for
    ``:latest`` (only the manifest moves when nothing changed);
  - the job's project has not pulled it on this node before: the registry checks that project's
    own login first, so a private image one tenant pulled is never handed to another from the
    cache (Kubernetes needs its AlwaysPullImages admission plugin for that).
  An image the operator put there (``docker load``, ``docker import``, the CI's busybox image) is
  not this cache's: it is used as it is by every project, and never removed.
- **With what login**: ``credentials()`` is called only when a pull is needed, and answers the
  project's login to the image's registry (the portal's agent API, from the node's own reply). It
  goes to the engine in the pull request's ``X-Registry-Auth`` header and is then dropped: no
  ``docker login``, no config file, nothing in a log; without a login the pull is anonymous (the
  node's own ``~/.docker/config.json`` is never used for jobs).
- **Progress**: ``progress(text)`` hears "pulling image REF: 43%" (bytes downloaded of the layers
  the engine has announced), at most every ``progress_interval_s``.
- **Size**: with a limit (``--image-cache-gb``), after each pull the least recently used images of
  this cache are removed until the cache fits, never one a container (running or not yet removed)
  uses nor one a launch in progress is about to use. Sizes are the engine's per image, so layers
  shared between images count once per image: the figure is an upper bound.

The cache's record is a JSON file in the driver's private folder: per reference, the image id,
its size, when a job last used it and the projects that pulled it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import docker.errors
import requests

from agents.protocol import image_registry, image_tag
from agents.sandbox import SandboxError

log = logging.getLogger(__name__)

PIN_S = 3600.0  # an image ensured for a launch is kept at least this long, or until its container exists


class PullStopped(SandboxError):
    """The launch was stopped while its image was being pulled."""


class ImageCache:
    def __init__(self, client, *, node: str, state_path=None, limit_bytes: int | None = None,
                 progress_interval_s: float = 2.0, clock=time.time):
        """``state_path``: the record's file, or a callable that makes its folder and answers it (on
        first use); None keeps the record in memory only."""
        self.client = client
        self.node = node
        self._state_path = state_path
        self.limit_bytes = limit_bytes or None
        self.progress_interval_s = progress_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pinned: dict[str, float] = {}  # reference -> when a launch ensured it
        self.pulls = 0  # pulls started (tests and bench read it)

    # -- the record ------------------------------------------------------------------------

    @property
    def state_path(self) -> Path | None:
        if callable(self._state_path):
            self._state_path = Path(self._state_path())
        return self._state_path

    def _load(self) -> dict:
        if self.state_path is None:
            return getattr(self, "_memory", {})
        try:
            data = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.error("image cache record %s is unreadable (%s): starting a new one", self.state_path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self, data: dict) -> None:
        if self.state_path is None:
            self._memory = data
            return
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.state_path)

    def records(self) -> dict:
        with self._lock:
            return self._load()

    # -- ensure ------------------------------------------------------------------------------

    def _present(self, ref: str):
        try:
            return self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            return None
        except (docker.errors.APIError, requests.RequestException) as exc:
            raise SandboxError(f"image {ref}: the Docker engine could not say whether it is here: {exc}") from None

    def needs_pull(self, ref: str, project: str) -> bool:
        image = self._present(ref)
        if image is None:
            return True
        rec = self.records().get(ref)
        if rec is None or rec.get("id") != image.id:
            return False  # the operator's image (or retagged by hand): not ours to refresh
        return image_tag(ref) == "latest" or project not in rec.get("projects", [])

    def ensure(self, ref: str, *, project_id: int | None, credentials, progress=None, stopped=None) -> str:
        """Make ``ref`` present for a job of ``project_id``: "present" (used as it is) or "pulled".
        SandboxError, with a message for the job's owner, when it cannot be pulled."""
        project = "-" if project_id is None else str(project_id)
        with self._lock:
            self._pinned[ref] = self._clock()
        if not self.needs_pull(ref, project):
            self._touch(ref, project=None)
            return "present"
        auth = credentials() or {}
        if auth.get("problem"):
            raise SandboxError(f"image {ref}: {auth['problem']}")
        login = {"username": auth["username"], "password": auth["password"]} if auth.get("username") else {}
        self._pull(ref, login, progress, stopped, bool(login))  # the login goes no further than this pull
        image = self._present(ref)
        if image is None:
            raise SandboxError(f"image {ref}: the pull ended but the engine does not have it")
        self._touch(ref, project=project, image=image)
        self.evict()
        return "pulled"

    def _pull(self, ref: str, login: dict, progress, stopped, with_login: bool) -> None:
        registry = image_registry(ref)
        who = "with the project's login" if with_login else "without a login (the project has none there)"
        self.pulls += 1
        log.info("node %s: pulling image %s from %s %s", self.node, ref, registry, who)
        layers: dict[str, list[int]] = {}  # layer id -> [bytes done, bytes in all]
        last = [0.0, -1]
        try:
            # auth_config={} when there is no login: never the agent's own docker config.
            stream = self.client.api.pull(ref, stream=True, decode=True, auth_config=login)
            for line in stream:
                if stopped is not None and stopped():
                    stream.close()
                    raise PullStopped(f"image {ref}: the pull was stopped")
                if line.get("error"):
                    raise SandboxError(_pull_failed(ref, registry, line["error"], with_login))
                _count(layers, line)
                if progress is not None:
                    done = sum(d for d, _ in layers.values())
                    total = sum(t for _, t in layers.values())
                    pct = int(done * 100 / total) if total else 0
                    now = self._clock()
                    if pct != last[1] and now - last[0] >= self.progress_interval_s:
                        last[:] = [now, pct]
                        progress(f"pulling image {ref}: {pct}%")
        except docker.errors.APIError as exc:
            raise SandboxError(_pull_failed(ref, registry, exc.explanation or str(exc), with_login)) from None
        except requests.RequestException as exc:
            raise SandboxError(f"image {ref}: the pull from {registry} broke off: {exc}") from None
        if progress is not None and last[1] != 100:
            progress(f"pulling image {ref}: 100%")

    def _touch(self, ref: str, *, project: str | None, image=None) -> None:
        with self._lock:
            data = self._load()
            rec = data.get(ref)
            if image is not None:
                if rec is None or rec.get("id") != image.id:  # new content: who may use it starts afresh
                    rec = {"id": image.id, "projects": []}
                rec["size"] = int(image.attrs.get("Size") or 0)
                if project not in rec["projects"]:
                    rec["projects"].append(project)
                data[ref] = rec
            if rec is None:
                return  # not ours
            rec["last_used"] = self._clock()
            self._save(data)

    def unpin(self, ref: str) -> None:
        """The launch that ensured ``ref`` made its container (or gave up): eviction may consider it."""
        with self._lock:
            self._pinned.pop(ref, None)

    # -- eviction ----------------------------------------------------------------------------

    def evict(self) -> list[str]:
        """Remove the least recently used images of this cache until it fits its limit. -> removed refs."""
        if self.limit_bytes is None:
            return []
        try:
            used = {c.get("ImageID") for c in self.client.api.containers(all=True)}
        except (docker.errors.APIError, requests.RequestException) as exc:
            log.warning("image cache: cannot list containers (%s); removing nothing", exc)
            return []
        removed = []
        with self._lock:
            data = self._load()
            now = self._clock()
            pinned = {r for r, t in self._pinned.items() if now - t < PIN_S}
            by_id: dict[str, dict] = {}
            for ref, rec in data.items():
                entry = by_id.setdefault(rec.get("id"), {"refs": [], "size": 0, "last_used": 0.0})
                entry["refs"].append(ref)
                entry["size"] = max(entry["size"], int(rec.get("size") or 0))
                entry["last_used"] = max(entry["last_used"], float(rec.get("last_used") or 0))
            total = sum(e["size"] for e in by_id.values())
            for image_id, entry in sorted(by_id.items(), key=lambda kv: kv[1]["last_used"]):
                if total <= self.limit_bytes:
                    break
                if image_id in used or pinned & set(entry["refs"]):
                    continue
                try:
                    for ref in entry["refs"]:
                        try:
                            self.client.images.remove(ref, noprune=False)
                        except docker.errors.ImageNotFound:
                            pass
                except docker.errors.APIError as exc:  # a container made meanwhile: keep it
                    log.info("image cache: kept %s (%s)", entry["refs"], exc.explanation or exc)
                    continue
                for ref in entry["refs"]:
                    data.pop(ref, None)
                total -= entry["size"]
                removed += entry["refs"]
            if removed:
                self._save(data)
        if removed:
            log.info("node %s: image cache over %d bytes: removed the least recently used %s", self.node,
                     self.limit_bytes, removed)
        return removed


def _count(layers: dict[str, list[int]], line: dict) -> None:
    """Fold one line of the engine's pull stream into per-layer [done, total] bytes."""
    layer, status = line.get("id"), line.get("status") or ""
    if not layer or layer == "latest" or ":" in layer:
        return
    detail = line.get("progressDetail") or {}
    if status == "Downloading" and detail.get("total"):
        layers[layer] = [int(detail.get("current") or 0), int(detail["total"])]
    elif status in ("Download complete", "Verifying Checksum", "Extracting", "Pull complete") and layer in layers:
        layers[layer][0] = layers[layer][1]
    elif status == "Already exists":
        layers[layer] = [1, 1]


def _pull_failed(ref: str, registry: str, why: str, with_login: bool) -> str:
    """The job's reason when its image cannot be pulled: what the registry said, and what to do."""
    low = why.lower()
    if any(w in low for w in ("unauthorized", "authentication required", "denied", "no basic auth")):
        if with_login:
            return (f"image {ref}: the registry {registry} refused the project's login ({why.strip()[:200]}); "
                    f"check it at /api/v1/registry-credentials/")
        return (f"image {ref}: the registry {registry} needs a login and the project has none for it "
                f"({why.strip()[:200]}); an owner sets one at /api/v1/registry-credentials/")
    if "not found" in low or "manifest unknown" in low:
        return f"image {ref}: not found in {registry} ({why.strip()[:200]})"
    return f"image {ref}: could not pull it from {registry}: {why.strip()[:300]}"
