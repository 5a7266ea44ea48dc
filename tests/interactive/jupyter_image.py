"""A JupyterLab job image built on this machine, for the docker sandbox's session tests.

No image registry is reachable from CI, so the image is made from what this machine already has:
this venv's Python (its standard library, without the test suite), the distributions JupyterLab
and ipykernel need as installed in the venv (found from their metadata, nothing else of the venv;
their data files too: JupyterLab's built application in share/jupyter/lab),
the shared libraries all of that links against (found with ldd), and Debian's busybox-static for
a shell. ``docker import`` turns the folder into an image. The tag is a hash of those inputs, so
an image is built once per change of Python, of those distributions or of this file (15 to 60 s),
and then reused; the previous one is removed.

    .venv/bin/python -m tests.interactive.jupyter_image     # prints the tag, building it if missing

The image runs ``python -m jupyterlab`` like any image with JupyterLab: the docker sandbox gives
it the session's settings (its unix socket, base URL and token) through JUPYTER_CONFIG_PATH.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

REPO = "gpuportal/jupyter"
ROOTS = ("jupyterlab", "ipykernel")
PY = "/opt/python"  # where the interpreter lives in the image
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages"}


def distributions() -> list[md.Distribution]:
    """JupyterLab, ipykernel and everything they require here (markers evaluated for this Python)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(ROOTS)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional extra's requirement that is not installed
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen.values(), key=lambda d: d.metadata["Name"].lower())


def tag() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for dist in distributions():
        digest.update(f"{dist.metadata['Name']}=={dist.version}\n".encode())
    digest.update(Path(__file__).read_bytes())  # a change of how it is built builds it again
    return f"{REPO}:{digest.hexdigest()[:12]}"


def _copy_stdlib(root: Path) -> None:
    src = Path(sysconfig.get_paths()["stdlib"])
    dst = root / PY.lstrip("/") / "lib" / src.name
    shutil.copytree(src, dst, symlinks=True, ignore=lambda d, names: [
        n for n in names if Path(d) == src and (n in STDLIB_SKIP or n.startswith("config-"))])
    (dst / "site-packages").mkdir()
    (root / PY.lstrip("/") / "bin").mkdir(parents=True)
    shutil.copy2(os.path.realpath(sys._base_executable), root / PY.lstrip("/") / "bin" / "python3")
    for alias in ("python", "python3.11"):
        os.symlink("python3", root / PY.lstrip("/") / "bin" / alias)


def _copy_distributions(root: Path) -> None:
    """Each distribution's files: its modules into site-packages, its data files (JupyterLab's built
    application in share/jupyter/lab, the servers' settings in etc/jupyter) under the image's prefix.
    Not the venv's bin/ scripts (their shebangs name the venv): the image runs python -m."""
    site = root / PY.lstrip("/") / "lib" / Path(sysconfig.get_paths()["stdlib"]).name / "site-packages"
    prefix = Path(sys.prefix).resolve()
    for dist in distributions():
        base = Path(dist.locate_file("")).resolve()
        for f in dist.files or []:
            src = Path(dist.locate_file(f)).resolve()
            if not src.is_file():
                continue
            if src.is_relative_to(base):
                dst = site / src.relative_to(base)
            elif src.is_relative_to(prefix) and src.relative_to(prefix).parts[0] in ("share", "etc"):
                dst = root / PY.lstrip("/") / src.relative_to(prefix)
            else:
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def _copy_libraries(root: Path) -> None:
    """Every shared library the interpreter and the copied extension modules load, from this machine."""
    objects = [root / PY.lstrip("/") / "bin" / "python3"]
    objects += [p for p in (root / PY.lstrip("/")).rglob("*.so*") if p.is_file()]
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "")
    shared = libdir / (sysconfig.get_config_var("INSTSONAME") or "")
    needed: set[str] = set()
    if shared.is_file() and sysconfig.get_config_var("Py_ENABLE_SHARED"):
        needed.add(str(shared))
        objects.append(shared)
    for obj in objects:
        out = subprocess.run(["ldd", str(obj)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            m = re.search(r"=>\s*(/\S+)", line) or re.match(r"\s*(/\S+)", line)
            if m and not m.group(1).startswith(str(root)):
                needed.add(m.group(1))
    for path in sorted(needed):
        if path == str(shared):  # the interpreter's own library: where the loader looks by default
            dst = root / "usr/lib/x86_64-linux-gnu" / Path(path).name
        else:
            dst = root / Path(path).relative_to("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            shutil.copy2(os.path.realpath(path), dst)


def _rootfs(root: Path) -> None:
    for d in ("usr/bin", "usr/lib/x86_64-linux-gnu", "usr/lib64", "etc", "tmp", "work", "proc", "sys", "dev", "run"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link, to in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        os.symlink(to, root / link)
    shutil.copy2("/bin/busybox", root / "usr/bin/busybox")
    for applet in subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True, check=True).stdout.split():
        if not (root / "usr/bin" / applet).exists():
            os.symlink("busybox", root / "usr/bin" / applet)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/work:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    os.chmod(root / "tmp", 0o1777)


def build(name: str, client) -> None:
    with tempfile.TemporaryDirectory(prefix="gpuportal-jupyter-image-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        _rootfs(root)
        _copy_stdlib(root)
        _copy_distributions(root)
        _copy_libraries(root)
        archive = Path(tmp) / "root.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(root, arcname=".")
        changes = [f"ENV PATH={PY}/bin:/usr/bin:/bin", "ENV LANG=C.UTF-8", "ENV PYTHONDONTWRITEBYTECODE=1",
                   "USER 65534:65534", "WORKDIR /work", 'CMD ["python3", "-m", "jupyterlab"]']
        argv = ["docker", "import", *[a for c in changes for a in ("--change", c)], str(archive), name]
        subprocess.run(argv, check=True, capture_output=True)


def ensure(client) -> str:
    """The image's tag, built first when this machine's engine does not have it."""
    import docker.errors

    name = tag()
    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        build(name, client)
        for old in client.images.list(name=REPO):  # an earlier build's: not needed any more
            if name not in old.tags:
                try:
                    client.images.remove(old.id)
                except docker.errors.APIError:
                    pass  # still used by a container, or removed by another run meanwhile
    return name


if __name__ == "__main__":
    import docker

    print(ensure(docker.from_env()))
