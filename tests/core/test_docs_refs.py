"""README.md, docs/ and the code's comments name only what exists: every repository path, every
dotted module name, every command the docs run, and every /api/v1/ route in docs/api.md's table.
Files move (portal/core/querysets.py went to tenancy, the nodes pages to portal/console/); this keeps
the words from pointing at what moved."""
import ast
import functools
import re
import subprocess
from pathlib import Path

from django.urls import get_resolver
from django.urls.resolvers import URLResolver

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOPS = ("portal", "scheduler", "agents", "tests", "bench", "deploy", "docs", "templates", "static", ".ci")
# A path in the repository as the docs write one: `portal/jobs/node_effects.py`, `agents/sandbox/`.
PATH = re.compile(r"(?<![\w/.\-=])((?:%s)/[\w./\-]*[\w/])" % "|".join(re.escape(t) for t in TOPS))
# A dotted module name, `portal.launch.launch_specs`, or a Celery task's name.
DOTTED = re.compile(r"(?<![\w./\-])((?:portal|scheduler|agents)(?:\.\w+)+)")


def doc_lines():
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            yield f"{doc.relative_to(REPO)}:{n}", line


def code_lines():
    """Every line of the repository's tracked code and configuration (comments, docstrings and
    strings such as a patch target included)."""
    tracked = subprocess.run(["git", "ls-files", "-z", *TOPS, "Makefile", ".importlinter", "pyproject.toml"],
                             cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in tracked:
        path = REPO / name
        if name == "tests/core/test_docs_refs.py":
            continue  # names what moved, as examples
        if not name or not path.is_file() or path.suffix not in {".py", ".sh", ".toml", ".ini", ".service",
                                                                  ".conf", ".example", ".html", ""}:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            yield f"{name}:{n}", line


def task_names() -> set[str]:
    names = set()
    for top in ("portal", "scheduler"):
        for f in (REPO / top).rglob("*.py"):
            names.update(re.findall(r'shared_task\([^)]*name="([\w.]+)"', f.read_text()))
    return names


@functools.cache
def top_level_names(module: Path) -> frozenset[str]:
    """What a module defines or imports at its top (and in its top-level if/try blocks)."""
    names = set()
    body = list(ast.parse(module.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(node, "targets", None) or [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body.extend(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                        + [s for h in getattr(node, "handlers", []) for s in h.body])
    return frozenset(names)


def dotted_exists(dotted: str, lenient: bool = False) -> bool:
    """Whether `portal.launch.launch_specs` names a module, or a name a module defines. Lenient (for
    code, where `portal` may be a variable): only names under an existing app or module count."""
    parts = dotted.split(".")
    if lenient and not (REPO.joinpath(*parts[:2]).is_dir() or REPO.joinpath(*parts[:2]).with_suffix(".py").exists()):
        return True
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists() or base.is_dir():
            rest = parts[i:]
            return not rest or (module.exists() and rest[0] in top_level_names(module))
    return False


def missing_paths(lines) -> list[str]:
    missing = []
    for where, line in lines:
        for m in PATH.finditer(line):
            path = m.group(1).rstrip(".")
            token = re.match(r"[^\s`'\"),;]*", line[m.start():]).group(0)
            if re.search(r"[<>{}*$%]", token):
                continue  # a pattern: `templates/<app>/`, `deploy/systemd/gpuportal-{web,...}.service`
            module, _, name = path.rpartition(".")  # `agents/datasets.DatasetCache`
            if not ((REPO / path).exists() or (REPO / f"{module}.py").exists()
                    and name in top_level_names(REPO / f"{module}.py")):
                missing.append(f"{where}: {path}")
    return missing


def missing_modules(lines, lenient: bool = False) -> list[str]:
    tasks = task_names()
    missing = []
    for where, line in lines:
        for m in DOTTED.finditer(line):
            dotted = m.group(1)
            if re.search(r"\.(py|md|html|txt|json|com|org)$", dotted) or dotted in tasks:
                continue
            if not dotted_exists(dotted, lenient):
                missing.append(f"{where}: {dotted}")
    return missing


def test_every_path_the_docs_name_exists():
    missing = missing_paths(doc_lines())
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_every_module_the_docs_name_exists():
    missing = missing_modules(doc_lines())
    assert not missing, "docs name modules or functions that do not exist:\n" + "\n".join(missing)


def test_every_path_and_module_the_code_names_exists():
    """A comment or docstring saying where something lives (`portal/jobs/node_effects.py`,
    `portal.launch.launch_specs`) points at a file or name that is there."""
    lines = list(code_lines())
    missing = missing_paths(lines) + missing_modules(lines, lenient=True)
    assert not missing, "the code names paths or modules that do not exist:\n" + "\n".join(missing)


def _routes(patterns, prefix=""):
    for p in patterns:
        if isinstance(p, URLResolver):
            yield from _routes(p.url_patterns, prefix + str(p.pattern))
        else:
            yield prefix + str(p.pattern)


def _fixed_parts(route: str) -> str:
    """`jobs/{id}/cancel/`, `^jobs/(?P<pk>[^/.]+)/cancel/$` and `jobs/<int:pk>/cancel/` all give
    `jobs/*/cancel`: the words of a route, with each parameter a star."""
    route = re.sub(r"\(\?P<\w+>[^)]*\)|<[^>]+>|\{[^}]+\}", "*", route)
    route = route.split("?")[0].replace("^", "").replace("$", "")  # a query string; a regex's anchors
    return "/".join(s for s in route.split("/") if s)


def test_docs_api_md_lists_every_api_v1_route():
    table = (REPO / "docs" / "api.md").read_text()
    documented = {_fixed_parts(m) for m in re.findall(r"`(?:[A-Z]+(?:/[A-Z]+)*) ([^`]+)`", table)}
    routes = {_fixed_parts(r.removeprefix("api/v1/")) for r in _routes(get_resolver().url_patterns)
              if r.startswith("api/v1/") and "format" not in r}
    assert len(routes) > 30
    missing = sorted(routes - documented)
    assert not missing, "docs/api.md's endpoint table lacks these /api/v1/ routes:\n" + "\n".join(missing)


def test_every_command_the_docs_run_exists():
    """`python -m portal.cli`, `python -m tests.faults`, `manage.py runstack`: each names a module
    of this repository that runs, or a management command Django knows."""
    from django.core.management import get_commands

    commands = get_commands()
    missing = []
    for where, line in doc_lines():
        for m in re.finditer(r"python3? -m ((?:portal|scheduler|agents|tests)(?:\.\w+)*)", line):
            base = REPO.joinpath(*m.group(1).split("."))
            if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
                missing.append(f"{where}: python -m {m.group(1)}")
        for m in re.finditer(r"manage\.py ([a-z_]+)\b", line):
            if m.group(1) not in commands and m.group(1) != "reads":  # "manage.py reads the same settings"
                missing.append(f"{where}: manage.py {m.group(1)}")
    assert not missing, "docs run commands that do not exist:\n" + "\n".join(missing)
