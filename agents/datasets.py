"""Datasets on a node: a content-addressed cache the agent manages, and the digest rule the portal shares.

A dataset version is a list of files, each ``{"path", "size", "sha256"}`` (an S3 prefix's objects, or
the one archive of an HTTP(S) URL or an upload); its **digest** is the sha256 of that list written
out in one canonical form (``manifest_digest``), so the portal and every node compute the same one.

The cache lives in the agent's state folder (``<state>/datasets-<node>``)::

    entries/<digest>/            a complete, verified version (files 0444, folders 0555), read-only
                                 in jobs at /datasets/<name>
    staging/<digest>.<random>/   a fetch in progress; removed when it fails
    index.json                   {digest: {size, last_used, pinned}}, written when entries come and go
    refs/<job id>:<attempt>      the digests one launch uses, made when it starts and removed when it
                                 ends: so a restarted agent still never evicts what an adopted job reads

Rules: a version is fetched once per node (a second launch waiting for the same digest waits for
the first fetch); every file's sha256 and size are checked while it downloads, and a mismatch
fails the launch saying so, leaving nothing in the cache; the cache never holds more than its
limit: the least recently used entries that no job uses and that are not pinned go first, and a
version that cannot fit is refused with the reason (``CacheFull``), never a crash. An entry a job
uses (its reference count above zero) is never evicted.

Plain Python with no Django import: the portal imports ``manifest_digest`` and ``check_file_path``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tarfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MOUNT_ROOT = "/datasets"  # a dataset appears in a container at /datasets/<name>
DIGEST = re.compile(r"[0-9a-f]{64}\Z")
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}\Z")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
CHUNK = 1024 * 1024
FETCH_TIMEOUT_S = 60.0


class DatasetError(Exception):
    """A dataset could not be staged; the message is for the job's owner."""


class ChecksumMismatch(DatasetError):
    """What was downloaded is not the version the portal recorded (the source changed)."""


class CacheFull(DatasetError):
    """The version does not fit in the node's cache (too big, or the rest is in use or pinned)."""


class CacheBusy(CacheFull):
    """The version would fit, but what jobs use, what is pinned and what is being fetched leave no
    room now: another node may start the job (the agent reports it not startable here)."""


def check_file_path(path: str) -> str:
    """A file's path inside a dataset: relative, '/'-separated, no '..', no empty or control parts."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        raise ValueError("a file path must be 1 to 1024 characters")
    if path.startswith("/") or "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ValueError(f"{path[:80]!r} is not a relative path of plain characters")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path[:80]!r} holds an empty, '.' or '..' part")
    return path


def manifest_digest(files: list[dict]) -> str:
    """The version's digest: sha256 over ``<sha256>  <size>  <path>\\n`` per file, sorted by path."""
    lines = "".join(f"{f['sha256']}  {int(f['size'])}  {f['path']}\n" for f in sorted(files, key=lambda f: f["path"]))
    return hashlib.sha256(lines.encode()).hexdigest()


def is_archive(path: str) -> bool:
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def label(ds: dict) -> str:
    return f"{ds.get('name')}@{ds.get('version')}"


@dataclass
class Entry:
    size: int
    last_used: float
    pinned: bool = False


@dataclass
class _Fetch:
    done: threading.Event = field(default_factory=threading.Event)
    error: DatasetError | None = None


class DatasetCache:
    """The node's dataset cache. Thread-safe: launches run on the agent's task threads."""

    def __init__(self, root: str, limit_bytes: int, *, clock=time.time, pinned: tuple[str, ...] = (), opener=None):
        self.root = os.path.abspath(root)
        # opener(url) -> a readable response (a context manager): urllib for http(s); the agent's opens
        # "agent:..." URLs (an upload kept by the portal) with its node token too.
        self.opener = opener or open_url
        self.limit = int(limit_bytes)
        self._clock = clock
        self._lock = threading.RLock()
        self._fetching: dict[str, _Fetch] = {}
        self._reserved: dict[str, int] = {}  # digest -> bytes held for a fetch in progress
        for sub in ("entries", "staging", "refs"):
            os.makedirs(os.path.join(self.root, sub), mode=0o711, exist_ok=True)
        for folder in (self.root, os.path.join(self.root, "entries")):
            # Searchable whatever the umask: a kvm VM's QEMU (a uid of its own) reads the entries it is given.
            os.chmod(folder, 0o711)
        shutil.rmtree(os.path.join(self.root, "staging"), ignore_errors=True)  # a fetch cut off by a restart
        os.makedirs(os.path.join(self.root, "staging"), mode=0o700, exist_ok=True)
        self.entries: dict[str, Entry] = {}
        self.refs: dict[str, set[str]] = {}  # digest -> "job_id:attempt" of the launches using it
        self._load()
        for digest in pinned:
            if digest in self.entries:
                self.entries[digest].pinned = True
        self._pins = set(pinned)  # pinned once fetched too

    # -- the index --------------------------------------------------------------------------------

    def _index_path(self) -> str:
        return os.path.join(self.root, "index.json")

    def _load(self) -> None:
        try:
            with open(self._index_path()) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = {}
        on_disk = {d for d in os.listdir(os.path.join(self.root, "entries")) if DIGEST.match(d)}
        for digest, e in (raw.get("entries") or {}).items():
            if digest in on_disk and isinstance(e, dict):
                self.entries[digest] = Entry(int(e.get("size") or 0), float(e.get("last_used") or 0),
                                             bool(e.get("pinned")))
        for digest in on_disk - set(self.entries):  # a folder the index lost (a crash between the two)
            shutil.rmtree(os.path.join(self.root, "entries", digest), ignore_errors=True)
        refs = os.path.join(self.root, "refs")
        for key in os.listdir(refs):
            try:
                with open(os.path.join(refs, key)) as f:
                    digests = json.load(f)
            except (OSError, ValueError):
                continue  # cut off while it was written: that launch never started its sandbox
            for digest in digests if isinstance(digests, list) else ():
                if digest in self.entries:
                    self.refs.setdefault(digest, set()).add(key)

    def _save(self) -> None:
        data = {"entries": {d: {"size": e.size, "last_used": e.last_used, "pinned": e.pinned}
                            for d, e in self.entries.items()}}
        tmp = f"{self._index_path()}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(json.dumps(data, separators=(",", ":")))  # one write: json.dump writes piece by piece
        os.replace(tmp, self._index_path())

    # -- what the portal and the scheduler see ------------------------------------------------------

    def digests(self) -> list[str]:
        """The complete, verified versions held: reported to the portal (Node.cached_datasets)."""
        with self._lock:
            return sorted(self.entries)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self.entries.values()) + sum(self._reserved.values())

    def path(self, digest: str) -> str:
        return os.path.join(self.root, "entries", digest)

    # -- references -------------------------------------------------------------------------------

    def keep_only(self, keys: set[str]) -> None:
        """After a restart: drop references of launches no sandbox is left for."""
        with self._lock:
            for digest in list(self.refs):
                self.refs[digest] &= keys
                if not self.refs[digest]:
                    del self.refs[digest]
            for key in os.listdir(os.path.join(self.root, "refs")):
                if key not in keys:
                    _unlink(self._ref_path(key))

    def release(self, key: str) -> None:
        """The launch ``key`` ("job_id:attempt") is over: its entries may be evicted again."""
        with self._lock:
            changed = False
            for digest in list(self.refs):
                if key in self.refs[digest]:
                    self.refs[digest].discard(key)
                    changed = True
                    if not self.refs[digest]:
                        del self.refs[digest]
            if changed:
                _unlink(self._ref_path(key))

    def pin(self, digest: str, pinned: bool = True) -> None:
        with self._lock:
            (self._pins.add if pinned else self._pins.discard)(digest)
            if digest in self.entries:
                self.entries[digest].pinned = pinned
                self._save()

    # -- staging ----------------------------------------------------------------------------------

    def acquire(self, key: str, datasets: list[dict], *, progress=None, cancelled=None) -> dict[str, str]:
        """Every dataset of one launch in the cache, referenced by ``key``: {name: host folder}.
        ``progress(text)`` hears how staging goes; ``cancelled()`` True stops it (DatasetError).
        On any failure the references taken so far are given back."""
        paths = {}
        try:
            for ds in datasets:
                paths[ds["name"]] = self._acquire_one(key, ds, progress, cancelled)
            with self._lock:  # one small file per launch: what a restarted agent must not evict
                with open(self._ref_path(key), "w") as f:
                    f.write(json.dumps(sorted(d for d, keys in self.refs.items() if key in keys)))
        except BaseException:
            self.release(key)
            raise
        return paths

    def _ref_path(self, key: str) -> str:
        return os.path.join(self.root, "refs", key.replace("/", "_"))

    def _acquire_one(self, key: str, ds: dict, progress, cancelled) -> str:
        digest = str(ds.get("digest") or "")
        if not DIGEST.match(digest) or not NAME.match(str(ds.get("name") or "")):
            raise DatasetError(f"dataset {label(ds)}: not a dataset the portal describes (digest, name)")
        while True:
            with self._lock:
                if digest in self.entries:
                    # A hit writes nothing: last_used goes to disk with the next change of entries.
                    self.entries[digest].last_used = self._clock()
                    self.refs.setdefault(digest, set()).add(key)
                    return os.path.join(self.path(digest), "data")
                fetch = self._fetching.get(digest)
                if fetch is None:
                    self._make_room(ds)  # raises CacheFull
                    fetch = self._fetching[digest] = _Fetch()
                    mine = True
                else:
                    mine = False
            if not mine:  # another launch fetches it: once per node
                if progress:
                    progress(f"staging dataset {label(ds)}: waiting for another job's download")
                while not fetch.done.wait(0.5):
                    if cancelled and cancelled():
                        raise DatasetError(f"dataset {label(ds)}: staging stopped")
                if fetch.error is not None:
                    raise type(fetch.error)(str(fetch.error))
                continue  # now an entry (or gone again: loop decides)
            try:
                size = self._fetch(ds, digest, progress, cancelled)
            except BaseException as exc:
                with self._lock:
                    self._reserved.pop(digest, None)
                    self._fetching.pop(digest, None)
                    fetch.error = exc if isinstance(exc, DatasetError) else DatasetError(
                        f"dataset {label(ds)}: {type(exc).__name__}: {exc}")
                fetch.done.set()
                if isinstance(exc, DatasetError):
                    raise
                raise fetch.error from exc
            with self._lock:
                self._reserved.pop(digest, None)
                self.entries[digest] = Entry(size, self._clock(), digest in self._pins)
                self._fetching.pop(digest, None)
                self._evict_over_limit()
                self._save()
            fetch.done.set()

    def _make_room(self, ds: dict) -> None:
        """Hold room for ``ds`` (its size, twice for an archive that is unpacked), evicting the least
        recently used entries no job uses and not pinned. Call with the lock held. CacheFull when it
        can never fit here, CacheBusy when the rest of the cache is held now."""
        need = int(ds.get("size") or 0) * (2 if ds.get("archive") else 1)
        if need > self.limit:
            raise CacheFull(f"dataset {label(ds)} ({human_size(ds.get('size') or 0)}"
                            f"{', unpacked from an archive' if ds.get('archive') else ''}) does not fit in this "
                            f"node's dataset cache (limit {human_size(self.limit)})")
        free = self.limit - self.used_bytes()
        for digest in sorted((d for d, e in self.entries.items() if not e.pinned and not self.refs.get(d)),
                             key=lambda d: self.entries[d].last_used):
            if free >= need:
                break
            free += self._evict(digest)
        if free < need:
            in_use = sum(e.size for d, e in self.entries.items() if self.refs.get(d))
            pinned = sum(e.size for d, e in self.entries.items() if e.pinned and not self.refs.get(d))
            raise CacheBusy(f"this node's dataset cache is full: dataset {label(ds)} needs "
                            f"{human_size(need)}, {human_size(max(free, 0))} free of {human_size(self.limit)} "
                            f"({human_size(in_use)} used by running jobs, {human_size(pinned)} pinned, "
                            f"{human_size(sum(self._reserved.values()))} being fetched)")
        self._reserved[str(ds["digest"])] = need

    def _evict_over_limit(self) -> None:
        """An unpacked archive may come out larger than its size: evict down to the limit again."""
        over = self.used_bytes() - self.limit
        for digest in sorted((d for d, e in self.entries.items() if not e.pinned and not self.refs.get(d)),
                             key=lambda d: self.entries[d].last_used):
            if over <= 0:
                break
            over -= self._evict(digest)

    def _evict(self, digest: str) -> int:
        entry = self.entries.pop(digest)
        path = self.path(digest)
        _make_writable(path)
        shutil.rmtree(path, ignore_errors=True)
        log.info("dataset cache: evicted %s (%s)", digest[:12], human_size(entry.size))
        return entry.size

    def discard(self, digest: str) -> None:
        """Remove an entry no job uses (an operator's or a test's)."""
        with self._lock:
            if digest in self.entries and not self.refs.get(digest):
                self._evict(digest)
                self._save()

    def _fetch(self, ds: dict, digest: str, progress, cancelled) -> int:
        """Download, verify and unpack into staging, then move into place. -> bytes on disk."""
        files = ds.get("files") or []
        for f in files:
            check_file_path(f.get("path"))
        if manifest_digest(files) != digest:
            raise ChecksumMismatch(f"dataset {label(ds)}: its file list does not give digest {digest[:12]}…")
        total = sum(int(f["size"]) for f in files) or 1
        staging = os.path.join(self.root, "staging", f"{digest}.{uuid.uuid4().hex[:8]}")
        data = os.path.join(staging, "data")
        os.makedirs(data, mode=0o700)
        done = 0
        last = [-1, 0.0]

        def tell(n):
            nonlocal done
            done += n
            pct = int(done * 100 / total)
            now = time.monotonic()
            if progress and pct != last[0] and (now - last[1] >= 1.0 or pct == 100):
                last[:] = [pct, now]
                progress(f"staging dataset {label(ds)}: {pct}%")

        try:
            if progress:
                progress(f"staging dataset {label(ds)}: 0% of {human_size(total)}")
            for f in files:
                target = os.path.join(data, *f["path"].split("/"))
                os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
                _download(f, target, ds, tell, cancelled, self.opener)
                if ds.get("archive"):
                    self._unpack(ds, target, data)
            size = _tree_size(data)
            _make_read_only(staging)
            os.rename(staging, self.path(digest))
            return size
        except BaseException:
            _make_writable(staging)
            shutil.rmtree(staging, ignore_errors=True)
            raise

    @staticmethod
    def _unpack(ds: dict, archive: str, into: str) -> None:
        """A tar archive unpacked in place of itself; tarfile's data filter refuses members that would
        leave the folder (absolute, '..', links out), devices, and drops set-uid bits."""
        try:
            with tarfile.open(archive) as tf:
                tf.extractall(into, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise DatasetError(f"dataset {label(ds)}: cannot unpack {os.path.basename(archive)}: {exc}") from None
        os.unlink(archive)


def open_url(url: str):
    if not url.startswith(("http://", "https://")):
        raise DatasetError(f"no http(s) URL to fetch it from ({url[:40]!r})")
    return urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S)


def _download(f: dict, target: str, ds: dict, tell, cancelled, opener) -> None:
    url = str(f.get("url") or "")
    h = hashlib.sha256()
    n = 0
    try:
        with opener(url) as resp, open(target, "xb") as out:
            while chunk := resp.read(CHUNK):
                if cancelled and cancelled():
                    raise DatasetError(f"dataset {label(ds)}: staging stopped")
                n += len(chunk)
                if n > int(f["size"]):
                    break
                h.update(chunk)
                out.write(chunk)
                tell(len(chunk))
    except DatasetError as exc:
        raise DatasetError(f"dataset {label(ds)}: could not fetch {f['path']}: {exc}") from None
    except OSError as exc:  # URLError, HTTPError, timeouts, a full disk (requests' errors are OSErrors too)
        raise DatasetError(f"dataset {label(ds)}: could not fetch {f['path']}: {exc}") from None
    if n != int(f["size"]) or h.hexdigest() != f["sha256"]:
        got = f"{n} bytes" if n != int(f["size"]) else f"sha256 {h.hexdigest()[:12]}…"
        raise ChecksumMismatch(
            f"dataset {label(ds)}: checksum mismatch on {f['path']}: got {got}, the version records "
            f"{f['size']} bytes with sha256 {f['sha256'][:12]}… (its source changed since the version was made); "
            f"the download was discarded")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _tree_size(path: str) -> int:
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _make_read_only(path: str) -> None:
    """Files 0444, folders 0555: any uid in a job reads them, none writes."""
    for folder, dirs, names in os.walk(path):
        for name in names:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                os.chmod(p, 0o444)
        os.chmod(folder, 0o555)


def _make_writable(path: str) -> None:
    """Owner-writable folders again, so the tree can be removed."""
    for folder, _, _ in os.walk(path):
        try:
            os.chmod(folder, 0o755)
        except OSError:
            pass
