"""A job's outputs: the files it leaves in ``/outputs``, uploaded to the portal when its attempt ends.

The folder belongs to the tenant's job, and the agent reads it as root, so it is walked through
directory descriptors without ever following a link: a symlink (to ``/etc/shadow``, to another
tenant's volume) is skipped and named in the job's end message, never read; so are FIFOs, sockets
and devices, and names that are not UTF-8. Regular files go up one by one, in path order. Where the
portal hands out a presigned URL of its S3-compatible storage for the file (protocol 1.6,
portal/storage/artifact_direct.py), the bytes go straight there and the agent then confirms them;
otherwise (a local storage, an older portal, or when the direct way fails: the storage unreachable from
the node, a refused confirm) each is the body of ``PUT /api/agent/v1/jobs/<id>/artifacts?attempt=&path=``
(agents/client.py), which the portal keeps (portal/storage/artifacts.py). Past the attempt's limits
the portal refuses with 413, after which the agent sends no more and says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass, field

import requests

from agents.client import PortalError, PortalUnreachable, StaleAttempt

log = logging.getLogger(__name__)

MAX_DEPTH = 64  # deeper folders are not walked (and said so)
MAX_ENTRIES = 100_000  # entries looked at per attempt, a bound on a hostile folder's cost


@dataclass
class Outputs:
    """What was found in an outputs folder: regular files (relative path, size) and what was skipped."""

    files: list[tuple[str, int]] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)  # why -> paths

    def skip(self, why: str, path: str) -> None:
        self.skipped.setdefault(why, []).append(path)


def scan(folder: str | os.PathLike) -> Outputs:
    """The regular files below ``folder``, never through a symlink (``folder`` itself included)."""
    out = Outputs()
    try:
        top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return out
    seen = [0]
    try:
        _walk(top, "", 0, out, seen)
    finally:
        os.close(top)
    out.files.sort()
    return out


def empty(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds nothing at all (or is gone): nothing to upload, nothing to name. A link
    is not empty: ``scan`` names it."""
    if os.path.islink(folder):
        return False
    try:
        with os.scandir(folder) as it:
            return next(it, None) is None
    except FileNotFoundError:  # as scan: gone is nothing; anything else goes to scan, which names it
        return True
    except OSError:
        return False


def _walk(fd: int, prefix: str, depth: int, out: Outputs, seen: list[int]) -> None:
    with os.scandir(fd) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        seen[0] += 1
        path = prefix + entry.name
        if seen[0] > MAX_ENTRIES:
            out.skip(f"past {MAX_ENTRIES} entries", path)
            return
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            out.skip("names not UTF-8", path.encode("utf-8", "replace").decode())
            continue
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            out.skip("symlinks (never followed)", path)
        elif stat.S_ISDIR(st.st_mode):
            if depth + 1 >= MAX_DEPTH:
                out.skip(f"folders deeper than {MAX_DEPTH}", path)
                continue
            try:
                child = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                out.skip("unreadable", path)
                continue
            try:
                _walk(child, path + "/", depth + 1, out, seen)
            finally:
                os.close(child)
        elif stat.S_ISREG(st.st_mode):
            out.files.append((path, st.st_size))
        else:
            out.skip("special files", path)


def open_file(folder: str | os.PathLike, relpath: str):
    """A binary file object for ``relpath`` below ``folder``, opened component by component without
    following any link; OSError if it is gone or is no longer a regular file."""
    parts = relpath.split("/")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(leaf).st_mode):
        os.close(leaf)
        raise OSError(f"{relpath} is not a regular file")
    return os.fdopen(leaf, "rb")


@dataclass
class Upload:
    """One attempt's upload, resumable across supervisor passes (the portal may be away a while)."""

    sent: set[str] = field(default_factory=set)
    files: int = 0
    size: int = 0
    problems: list[str] = field(default_factory=list)
    done: bool = False
    relay: bool = False  # through the portal: it offers no presigned URLs, or the direct way failed once
    direct: int = 0  # files that went straight to the storage

    def note(self, skipped: dict[str, list[str]]) -> str:
        """What the job's end message says about its outputs ("" when all went up)."""
        parts = [f"{len(paths)} {why} not uploaded ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})"
                 for why, paths in sorted(skipped.items())]
        return "; ".join(["outputs: " + "; ".join(parts + self.problems)] if parts or self.problems else [])


def upload(client, job_id: str, attempt: int, folder: str | os.PathLike, state: Upload) -> str:
    """Upload what ``folder`` holds that ``state`` has not sent yet. Returns the note for the job's end
    message. Raises PortalUnreachable (``state`` keeps what went up: call again later)."""
    found = scan(folder)
    for relpath, size in found.files:
        if relpath in state.sent:
            continue
        try:
            with open_file(folder, relpath) as f:
                _send(client, job_id, attempt, relpath, f, size, state)
        except OSError as exc:  # changed under us: the job is over, so only a bug or the operator did that
            state.problems.append(f"{relpath} unreadable ({exc.strerror or exc})")
            state.sent.add(relpath)
            continue
        except StaleAttempt as exc:
            state.problems.append(f"the portal took no artifacts ({exc})")
            break
        except PortalUnreachable:
            raise
        except PortalError as exc:
            if exc.status == 413:
                left = len([p for p, _ in found.files if p not in state.sent])
                state.problems.append(f"{left} file(s) not uploaded: {exc}")
                break
            state.problems.append(f"{relpath} refused ({exc})")
            state.sent.add(relpath)
            continue
        state.sent.add(relpath)
        state.files += 1
        state.size += size
    state.done = True
    log.info("job %s attempt %s: %d output file(s) (%d straight to the storage), %d bytes uploaded", job_id,
             attempt, state.files, state.direct, state.size)
    return state.note(found.skipped)


def _send(client, job_id: str, attempt: int, relpath: str, f, size: int, state: Upload) -> None:
    """One file: straight to the storage where the portal offers a presigned URL, else through the
    portal. A failure of the direct way (other than the attempt's limits) sends this file, and the
    rest of the attempt's, through the portal, whose answer then decides."""
    if not state.relay:
        try:
            if _direct(client, job_id, attempt, relpath, f, size):
                state.direct += 1
                return
        except PortalError as exc:
            if exc.status == 413 or isinstance(exc, (StaleAttempt, PortalUnreachable)):
                raise
            log.warning("job %s attempt %s: %s not uploaded straight to the storage (%s): through the portal",
                        job_id, attempt, relpath, exc)
        except requests.RequestException as exc:  # the storage is out of the node's reach
            log.warning("job %s attempt %s: the storage did not take %s (%s): through the portal",
                        job_id, attempt, relpath, exc)
        state.relay = True
    client.artifact(job_id, attempt, relpath, f, size)


def _direct(client, job_id: str, attempt: int, relpath: str, f, size: int) -> bool:
    """Upload ``f`` at a presigned URL and confirm it; False when the portal says to relay."""
    offer = client.artifact_upload_url(job_id, attempt, relpath, size)
    if offer.get("relay", True) or not offer.get("url"):
        return False
    digest = hashlib.sha256()
    while chunk := f.read(1024 * 1024):
        digest.update(chunk)
    client.storage_put(offer["url"], f, size)
    client.artifact_confirm(job_id, attempt, relpath, size, digest.hexdigest())
    return True
