"""pyproject.toml's extras: what `pip install .[cli]`, `.[agent]` and `.[portal]` give."""
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s#;]+)", line)
        if m:
            out[m[1].lower()] = m[3]
    return out


def test_every_extra_pins_what_requirements_txt_pins():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"cli", "agent", "portal", "kvm"} <= set(extras)
    required = pins((REPO / "requirements.txt").read_text().splitlines())
    for name, deps in extras.items():
        got = pins(deps)
        assert len(got) == len(deps), f"[{name}]: every dependency is pinned with =="
        for pkg, version in got.items():
            assert required.get(pkg) == version, f"[{name}] pins {pkg}=={version}, requirements.txt {required.get(pkg)}"


def test_the_cli_loads_no_settings_and_needs_no_debug():
    """gpuctl runs where the portal's settings cannot load (no SECRET_KEY, no DEBUG)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY", "DJANGO_SETTINGS_MODULE")}
    code = "import sys, portal.cli.app; print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'celery')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_pip_install_cli_extra_gives_a_working_gpuctl(tmp_path):
    """A fresh virtualenv with only `.[cli]`: gpuctl starts and explains what to do first."""
    # From a copy of what a source distribution holds: setuptools writes build/ into the tree it builds.
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "README.md", "portal", "scheduler", "agents"):
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy
        copy(REPO / part, src / part, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if (REPO / part).is_dir() else {}))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", f"{src}[cli]"],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "GPUCTL_CONFIG": str(tmp_path / "gpuctl.json")}
    helped = subprocess.run([str(venv / "bin" / "gpuctl"), "--help"], cwd=tmp_path, env=env, capture_output=True,
                            text=True)
    assert helped.returncode == 0 and "submit" in helped.stdout, helped.stderr[-2000:]
    listed = subprocess.run([str(venv / "bin" / "gpuctl"), "list"], cwd=tmp_path, env=env, capture_output=True,
                            text=True)
    assert listed.returncode != 0 and "gpuctl login --url" in listed.stderr + listed.stdout
    # Only what the CLI needs came along.
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import django"], capture_output=True)
    assert probe.returncode != 0
