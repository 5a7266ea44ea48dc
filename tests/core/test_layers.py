"""The import rules of .importlinter hold (docs/design.md section 2, "Layers"): the agent and the
scheduler core import neither Django nor the portal, each portal layer imports only the layers
below it, and no app's modules import each other in a circle."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    # lint-imports is the console script of import-linter, installed beside this Python.
    script = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(script), "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_every_import_contract_is_kept():
    result = lint_imports()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_broken_layer_fails_the_check(tmp_path):
    # The same rules with one more forbidden import: the checker must see it and fail.
    config = (ROOT / ".importlinter").read_text() + (
        "\n[importlinter:contract:probe]\nname = probe\ntype = forbidden\n"
        "source_modules =\n    portal.jobs.services\nforbidden_modules =\n    portal.jobs.models\n")
    probe = tmp_path / "probe.ini"
    probe.write_text(config)
    result = lint_imports("--config", str(probe), "--contract", "probe")
    assert result.returncode == 1
    assert "BROKEN" in result.stdout and "portal.jobs.services -> portal.jobs.models" in result.stdout
