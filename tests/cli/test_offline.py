"""gpuctl without a portal: spec building, URLs, errors before any request, and no Django inside."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from portal.cli import output
from portal.cli.app import SpecError, app, build_spec
from portal.cli.client import normalize_url
from portal.jobs.models import TERMINAL

REPO = Path(__file__).resolve().parents[2]


def gpuctl(*args, **env):
    return CliRunner().invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)


@pytest.fixture(autouse=True)
def no_config(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCTL_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.delenv("GPUCTL_URL", raising=False)
    monkeypatch.delenv("GPUCTL_TOKEN", raising=False)


def test_terminal_states_match_the_portals():
    assert output.TERMINAL == {str(s) for s in TERMINAL}


def test_the_cli_imports_no_django_app_machinery():
    code = ("import sys, portal.cli.app; bad = [m for m in sys.modules if m.startswith("
            "('django.db', 'django.apps', 'rest_framework', 'portal.jobs', 'portal.core'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_cli_starts_without_what_only_some_commands_use():
    """Start-up time: requests (urllib3), PyYAML and importlib.metadata load when a command needs
    them (an API call, a YAML spec, the version), not for --help or a local command."""
    code = ("import sys, portal.cli.app; print(sorted(m for m in ('requests', 'urllib3', 'yaml', 'importlib.metadata', "
            "'django') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_flags_override_file_fields_and_merge_env(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"project": "vision", "command": "python train.py", "env": {"A": 1, "B": True},
                                "resources": {"gpus": 1, "memory_mb": 8192}}))
    built = build_spec(str(spec), {"project": None, "priority": "high"}, {"gpus": 2, "cpus": None},
                       ["A=2", "C=x=y"], ["3,4", "5"], [])
    assert built == {"project": "vision", "priority": "high", "command": ["python", "train.py"], "name": "python",
                     "env": {"A": "2", "B": "true", "C": "x=y"}, "resources": {"gpus": 2, "memory_mb": 8192},
                     "depends_on": [3, 4, 5]}


def test_a_template_keeps_its_name():
    assert "name" not in build_spec(None, {"template": "base"}, {}, [], [], ["train"])


@pytest.mark.parametrize("env,depends", [(["NOT_SET_ANYWHERE_42"], []), ([], ["x"])])
def test_bad_flags_are_spec_errors(env, depends):
    with pytest.raises(SpecError):
        build_spec(None, {}, {}, env, depends, [])


def test_a_command_with_unbalanced_quotes_is_a_spec_error(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("command: echo 'unterminated\n")
    result = gpuctl("submit", "-f", spec, GPUCTL_URL="http://x", GPUCTL_TOKEN="t")
    assert result.exit_code == 2 and "No closing quotation" in result.stderr


@pytest.mark.parametrize("given,expected", [
    ("https://portal.example.com/", "https://portal.example.com"),
    ("portal.example.com/api/v1/", "https://portal.example.com"),
    ("http://localhost:8000/api", "http://localhost:8000"),
])
def test_urls_are_normalized(given, expected):
    assert normalize_url(given) == expected


def test_not_logged_in_says_how_to_log_in():
    result = gpuctl("list")
    assert result.exit_code == 3 and "gpuctl login --url URL" in result.stderr


def test_connection_error_names_the_url():
    result = gpuctl("list", GPUCTL_URL="http://127.0.0.1:9", GPUCTL_TOKEN="gpp_x")
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:9" in result.stderr


def test_logs_follow_with_json_is_refused():
    assert gpuctl("logs", "-f", "1", "-o", "json", GPUCTL_URL="http://x", GPUCTL_TOKEN="t").exit_code == 2


def test_table_pads_columns_and_cuts_long_cells():
    text = output.table([[1, "a-very-long-name"], [22, "b"]], ["ID", "NAME"], max_width={1: 8})
    assert text.splitlines() == ["ID  NAME", "1   a-very-…", "22  b"]


@pytest.mark.parametrize("args", [["submit", "--help"], ["volumes", "--help"], ["volumes", "list", "--help"],
                                  ["list", "--limit", "x"], ["port-forward", "--help"], ["sumbit"], ["--help"]])
def test_a_process_builds_only_the_command_it_runs_and_says_the_same(args):
    """main() hands typer only the named command (start-up time); help and errors stay the same."""
    from portal.cli.app import only_the_invoked_command

    runner = CliRunner()
    env = {"GPUCTL_URL": "http://127.0.0.1:1", "GPUCTL_TOKEN": "t", "COLUMNS": "100"}
    pruned = only_the_invoked_command(["gpuctl", *args])
    whole = runner.invoke(app, args, prog_name="gpuctl", env=env)
    assert (pruned is app) == (args[0] in ("sumbit", "--help"))
    assert len(pruned.registered_commands) + len(pruned.registered_groups) == (21 if pruned is app else 1)
    assert runner.invoke(pruned, args, prog_name="gpuctl", env=env).output == whole.output
    assert whole.exit_code in (0, 2) and whole.output
