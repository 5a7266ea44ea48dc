"""gpuctl converts plain option values without pydantic, to exactly what typer's adapters give,
and leaves every value it is not sure of (and so every error message) to typer."""
import subprocess
import sys
from pathlib import Path

import pytest
from typer import core
from typer._coercion import TypeDescriptor
from typer.models import OptionInfo
from typer.testing import CliRunner

import portal.cli.app  # noqa: F401 (installs the fast path)
from portal.cli import fastparams
from portal.cli.app import app
from portal.cli.output import Format

REPO = Path(__file__).resolve().parents[2]
ORIGINAL = core.build_runtime_param.__closure__  # the wrapped typer function lives in the closure


def typer_original():
    cells = {cell.cell_contents for cell in ORIGINAL if callable(cell.cell_contents)}
    return next(fn for fn in cells if getattr(fn, "__name__", "") == "build_runtime_param")


CASES = [
    (str, {}, ["x", "", " a b ", "é", b"bytes", 3]),
    (bool, {}, [True, False, "true", "0", ""]),
    (int, {}, [0, 1, -4, "1", "01", "-7", "+3", " 5", "1_000", "1.0", "x", "99999999999999999999", 1.0, True]),
    (int, {"min": 1, "max": 500}, ["1", "500", "0", "501", 20, 50]),
    (float, {}, [0.5, 2, "1", "0.25", "-3.5", "1e3", ".5", "inf", "nan", "x", True]),
    (float, {"min": 0.05}, ["0.05", "0.01", 2.0, "0"]),
    (float, {"min": 0, "clamp": True}, ["-1", "3"]),
    (Format, {"case_sensitive": False}, [Format.table, "json", "JSON", "Table", "yaml"]),
    (Format, {}, ["json", "JSON"]),
    (list[str], {}, [("a", "b"), ["x"], (), "ab", (b"x",)]),
]


def outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 (the comparison is the point)
        return "error", str(exc)


@pytest.mark.parametrize(("annotation", "options", "values"), CASES, ids=[repr(c[:2]) for c in CASES])
def test_the_fast_path_gives_what_typers_adapter_gives(annotation, options, values):
    info = OptionInfo(**options)
    descriptor = TypeDescriptor(annotation=annotation, parameter_info=info, file_annotation=None)
    fast = core.build_runtime_param(descriptor)
    slow = typer_original()(descriptor)
    assert type(fast).__name__ == "FastRuntimeParam"
    taken = 0
    for value in values:
        got = outcome(lambda: fast.coerce(value, param=None, ctx=None))
        want = outcome(lambda: slow.coerce(value, param=None, ctx=None))
        assert got == want, value
        assert type(got[1]) is type(want[1]), value
        taken += fastparams._convert(annotation, info, value, None) is not fastparams._SLOW
    assert taken, "the fast path took none of the values"


def test_bad_values_keep_typers_messages(monkeypatch):
    def run(*args):
        result = CliRunner().invoke(app, list(args), env={"GPUCTL_URL": "http://127.0.0.1:1", "GPUCTL_TOKEN": "t"})
        return result.exit_code, result.output

    bad = [("list", "--limit", "0"), ("list", "--limit", "x"), ("list", "--limit", "501"), ("list", "-o", "yaml"),
           ("logs", "1", "--interval", "0.01"), ("submit", "-p", "v", "--gpus", "two", "--", "true")]
    fast = [run(*args) for args in bad]
    monkeypatch.setattr(core, "build_runtime_param", typer_original())
    assert fast == [run(*args) for args in bad]
    assert all(code == 2 and "Invalid value for" in output for code, output in fast), fast
    assert "'yaml' is not one of" in fast[3][1] and "'table'" in fast[3][1]


def test_a_submit_loads_no_pydantic(tmp_path):
    code = ("import sys, portal.cli.app as a\nsys.argv = ['gpuctl', 'submit', '-p', 'vision', '--image', 'x', "
            "'--gpus', '1', '--', 'true']\ntry:\n    a.main()\nexcept SystemExit:\n    pass\n"
            "print('pydantic' in sys.modules, file=sys.stderr)")
    env = {"GPUCTL_URL": "http://127.0.0.1:1", "GPUCTL_CONFIG": str(tmp_path / "c.json"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert "no portal token configured" in out.stderr
    assert out.stderr.strip().endswith("False"), out.stderr


def test_a_bugs_traceback_still_prints_when_rich_loads_late(tmp_path):
    """gpuctl's process defers rich.markdown and rich.traceback; typer's pretty traceback of an
    uncaught exception still loads and prints, and --help never loads them."""
    code = ("import sys, typer\nfrom portal.cli import fastparams\nfastparams.defer_help_only_modules()\n"
            "app = typer.Typer(pretty_exceptions_show_locals=False)\n@app.command()\ndef boom(n: int = 1):\n"
            "    '''Raise.'''\n    raise ValueError('boom ' + str(n))\n@app.command()\ndef other():\n    pass\n"
            "if sys.argv[1] == 'help':\n    try:\n        app(['--help'])\n    except SystemExit:\n        pass\n"
            "    print(sorted(m for m in ('rich.markdown', 'markdown_it', 'rich.traceback') "
            "if m in sys.modules and not getattr(sys.modules[m], '_gpuctl_deferred', False)))\nelse:\n    app(['boom', '--n', '3'])\n")
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "100", "TERM": "dumb"}
    crash = subprocess.run([sys.executable, "-c", code, "crash"], cwd=REPO, capture_output=True, text=True, env=env)
    assert crash.returncode == 1
    assert "Traceback (most recent call last)" in crash.stderr and "ValueError: boom 3" in crash.stderr, crash.stderr
    help_ = subprocess.run([sys.executable, "-c", code, "help"], cwd=REPO, capture_output=True, text=True, env=env)
    assert "Raise." in help_.stdout and help_.stdout.strip().endswith("[]"), help_.stdout + help_.stderr
