"""The node's dataset cache (agents/datasets.py) against a real HTTP server on loopback: fetched once per
node, checksums verified (a mismatch leaves nothing behind), read-only, LRU eviction that never touches
an entry in use or pinned, a clear refusal when a version cannot fit, and tar archives unpacked safely."""
import hashlib
import os
import stat
import threading

import pytest

from agents.datasets import CacheFull, ChecksumMismatch, DatasetCache, DatasetError, manifest_digest
from tests.httpfiles import tar_archive

MB = 1024 * 1024


def version(server, name, files: dict[str, bytes], number=1, archive=False) -> dict:
    """A launch spec's dataset entry for `files` served by `server` (what the portal sends)."""
    entries = []
    for path, data in files.items():
        url = server.put(f"{name}-{number}/{path}", data)
        entries.append({"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "url": url})
    listed = [{k: f[k] for k in ("path", "size", "sha256")} for f in entries]
    return {"name": name, "version": number, "digest": manifest_digest(listed), "size": sum(len(d) for d in
                                                                                           files.values()),
            "archive": archive, "files": entries}


@pytest.fixture
def cache(tmp_path):
    return DatasetCache(str(tmp_path / "cache"), 10 * MB)


def test_fetched_once_verified_and_read_only(cache, http_files):
    ds = version(http_files, "tiny", {"a.txt": b"alpha\n", "sub/b.bin": b"\x00" * 5000})
    said = []
    paths = cache.acquire("1:1", [ds], progress=said.append)
    folder = paths["tiny"]
    assert open(os.path.join(folder, "a.txt"), "rb").read() == b"alpha\n"
    assert os.path.getsize(os.path.join(folder, "sub", "b.bin")) == 5000
    # Read-only for everyone, the job's uid included: files 0444, folders 0555.
    assert stat.S_IMODE(os.stat(os.path.join(folder, "a.txt")).st_mode) == 0o444
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o555
    assert said[0].startswith("staging dataset tiny@1: 0% of") and said[-1] == "staging dataset tiny@1: 100%"
    assert cache.digests() == [ds["digest"]]

    # Another job on the node: no second download, same folder.
    assert cache.acquire("2:1", [ds]) == paths
    assert http_files.requests["/tiny-1/a.txt"] == 1 and http_files.requests["/tiny-1/sub/b.bin"] == 1
    assert cache.refs[ds["digest"]] == {"1:1", "2:1"}


def test_a_changed_source_fails_the_launch_and_leaves_nothing(cache, http_files, tmp_path):
    ds = version(http_files, "drift", {"data.csv": b"1,2,3\n"})
    http_files.put("drift-1/data.csv", b"1,2,4\n")  # same size, other bytes: the source changed
    with pytest.raises(ChecksumMismatch, match=r"checksum mismatch on data.csv: got sha256 .* the download was "
                                               r"discarded"):
        cache.acquire("1:1", [ds])
    assert cache.digests() == [] and cache.refs == {} and cache.used_bytes() == 0
    assert os.listdir(tmp_path / "cache" / "staging") == [] and os.listdir(tmp_path / "cache" / "entries") == []

    http_files.put("drift-1/data.csv", b"1,2,3,4,5\n")  # a size that differs
    with pytest.raises(ChecksumMismatch, match="got 10 bytes"):
        cache.acquire("1:1", [ds])


def test_too_big_and_full_are_refused_with_reasons(tmp_path, http_files):
    cache = DatasetCache(str(tmp_path / "c"), 3 * MB)
    big = version(http_files, "big", {"x": b"x" * (4 * MB)})
    with pytest.raises(CacheFull, match=r"dataset big@1 \(4.0 MB\) does not fit in this node's dataset cache "
                                        r"\(limit 3.0 MB\)"):
        cache.acquire("1:1", [big])
    assert http_files.requests["/big-1/x"] == 0  # refused before any download

    one = version(http_files, "one", {"x": b"1" * (2 * MB)})
    two = version(http_files, "two", {"x": b"2" * (2 * MB)})
    cache.acquire("1:1", [one])
    with pytest.raises(CacheFull, match=r"cache is full: dataset two@1 needs 2.0 MB, 1.0 MB free of 3.0 MB "
                                        r"\(2.0 MB used by running jobs"):
        cache.acquire("2:1", [two])
    assert cache.digests() == [one["digest"]]  # in use: never evicted


def test_lru_eviction_skips_entries_in_use_and_pinned(tmp_path, http_files):
    now = [1000.0]
    cache = DatasetCache(str(tmp_path / "c"), 5 * MB, clock=lambda: now[0])
    a, b, c, d = (version(http_files, n, {"x": n.encode() * (2 * MB)}) for n in "abcd")
    for key, ds in (("1:1", a), ("2:1", b)):
        cache.acquire(key, [ds])
        now[0] += 10
        cache.release(key)
    cache.acquire("3:1", [a])  # a is now the most recently used; b the least
    cache.release("3:1")
    now[0] += 10
    cache.acquire("4:1", [c])  # 6 MB > 5: b goes
    assert set(cache.digests()) == {a["digest"], c["digest"]}
    cache.pin(a["digest"])
    with pytest.raises(CacheFull, match=r"2.0 MB used by running jobs, 2.0 MB pinned"):
        cache.acquire("5:1", [d])  # c in use, a pinned: nothing may go
    cache.release("4:1")
    cache.acquire("5:1", [d])  # c released: it goes, the pinned one stays
    assert set(cache.digests()) == {a["digest"], d["digest"]}


def test_one_download_for_launches_racing_for_the_same_version(cache, http_files):
    ds = version(http_files, "shared", {"x": os.urandom(3 * MB)})
    results, errors = [], []

    def launch(key):
        try:
            results.append(cache.acquire(key, [ds])["shared"])
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=launch, args=(f"{i}:1",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(set(results)) == 1 and len(results) == 4
    assert http_files.requests["/shared-1/x"] == 1


def test_index_survives_a_restart_and_drops_references_of_gone_launches(tmp_path, http_files):
    ds = version(http_files, "keep", {"x": b"k" * 1000})
    first = DatasetCache(str(tmp_path / "c"), 10 * MB)
    first.acquire("1:1", [ds])
    first.acquire("2:1", [ds])
    again = DatasetCache(str(tmp_path / "c"), 10 * MB)
    assert again.digests() == [ds["digest"]] and again.refs[ds["digest"]] == {"1:1", "2:1"}
    again.keep_only({"2:1"})  # the agent adopted only job 2's sandbox
    assert again.refs[ds["digest"]] == {"2:1"}
    again.acquire("3:1", [ds])
    assert http_files.requests["/keep-1/x"] == 1


def test_an_archive_is_unpacked_and_one_escaping_is_refused(cache, http_files, tmp_path):
    ds = version(http_files, "arch", {"set.tar.gz": tar_archive({"train/1.txt": b"one", "val/2.txt": b"two"})},
                 archive=True)
    folder = cache.acquire("1:1", [ds])["arch"]
    assert sorted(os.listdir(folder)) == ["train", "val"]  # unpacked, the archive itself gone
    assert open(os.path.join(folder, "train", "1.txt")).read() == "one"

    evil = tar_archive({"ok.txt": b"x"}, link=("../../escape", "/etc/passwd"))
    bad = version(http_files, "evil", {"e.tar.gz": evil}, archive=True)
    with pytest.raises(DatasetError, match="cannot unpack e.tar.gz"):
        cache.acquire("2:1", [bad])
    assert not (tmp_path / "cache" / "escape").exists() and bad["digest"] not in cache.digests()


def test_a_spec_whose_files_do_not_give_its_digest_is_refused(cache, http_files):
    ds = version(http_files, "lie", {"x": b"data"})
    ds["digest"] = "0" * 64
    with pytest.raises(ChecksumMismatch, match="does not give digest"):
        cache.acquire("1:1", [ds])
    assert http_files.requests["/lie-1/x"] == 0
