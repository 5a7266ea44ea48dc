"""deploy/: the systemd units pass `systemd-analyze verify`, the env templates name what the
units and settings read."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = sorted((REPO / "deploy" / "systemd").glob("*.service"))


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if not path:
        pytest.fail("systemd-analyze is missing: .ci/services.sh installs it (apt-get install systemd)", pytrace=False)
    return path


def test_there_is_a_unit_for_web_sessions_worker_beat_and_agent():
    assert {u.stem for u in UNITS} == {"gpuportal-web", "gpuportal-sessions", "gpuportal-worker", "gpuportal-beat",
                                       "gpuportal-agent"}


def test_systemd_analyze_verify_passes(tmp_path):
    """The units as installed, with /opt/gpuportal pointing at this checkout (verify checks that
    every ExecStart program exists and is executable)."""
    for unit in UNITS:
        text = unit.read_text()
        assert "/opt/gpuportal/" in text and "EnvironmentFile=/etc/gpuportal/" in text
        (tmp_path / unit.name).write_text(text.replace("/opt/gpuportal", str(REPO)))
    out = subprocess.run([systemd_analyze(), "verify", *sorted(str(p) for p in tmp_path.glob("*.service"))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_verify_would_catch_a_broken_unit(tmp_path):
    """The check above can fail: a typo in a directive and a missing program are reported."""
    bad = (REPO / "deploy/systemd/gpuportal-worker.service").read_text().replace("/opt/gpuportal/.venv", "/nonexistent")
    (tmp_path / "gpuportal-worker.service").write_text(bad.replace("KillMode=mixed", "KillMode=sometimes"))
    out = subprocess.run([systemd_analyze(), "verify", str(tmp_path / "gpuportal-worker.service")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "/nonexistent" in out.stderr and "kill mode" in out.stderr.lower()


def test_env_templates_set_every_variable_the_units_use():
    portal_env = (REPO / "deploy/portal.env.example").read_text()
    agent_env = (REPO / "deploy/agent.env.example").read_text()
    for unit in UNITS:
        env = agent_env if "agent" in unit.stem else portal_env
        for var in re.findall(r"\$\{?([A-Z_]+)", unit.read_text()):
            if var != "MAINPID":
                assert re.search(rf"^{var}=", env, re.M), f"{unit.name} uses ${var}, its env file template lacks it"
    # Authenticated connections: a password in the database and broker URLs.
    assert re.search(r"^DATABASE_URL=postgres://\w+:[^@\s]+@", portal_env, re.M)
    assert re.search(r"^CELERY_BROKER_URL=rediss?://[^:\s]*:[^@\s]+@", portal_env, re.M)
    assert re.search(r"^CELERY_BROKER_URL=rediss?://[^:\s]*:[^@\s]+@", agent_env, re.M)
    assert re.search(r"^DEBUG=0$", portal_env, re.M) and re.search(r"^USE_X_FORWARDED_PROTO=1$", portal_env, re.M)
