"""README.md and docs/ name only what exists: every repository path, every dotted module name, and
every /api/v1/ route in docs/api.md's table. Files move (portal/core/querysets.py went to tenancy,
the nodes pages to portal/console/); this keeps the docs from pointing at what moved."""
import re
from pathlib import Path

from django.urls import get_resolver
from django.urls.resolvers import URLResolver

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOPS = ("portal", "scheduler", "agents", "tests", "bench", "deploy", "docs", "templates", "static", ".ci")
# A path in the repository as the docs write one: `portal/jobs/node_effects.py`, `agents/sandbox/`.
PATH = re.compile(r"(?<![\w/.\-])((?:%s)/[\w./\-]*[\w/])" % "|".join(re.escape(t) for t in TOPS))
# A dotted module name, `portal.launch.launch_specs`, or a Celery task's name.
DOTTED = re.compile(r"(?<![\w./\-])((?:portal|scheduler|agents)(?:\.\w+)+)")


def doc_lines():
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            yield f"{doc.relative_to(REPO)}:{n}", line


def task_names() -> set[str]:
    names = set()
    for top in ("portal", "scheduler"):
        for f in (REPO / top).rglob("*.py"):
            names.update(re.findall(r'shared_task\([^)]*name="([\w.]+)"', f.read_text()))
    return names


def defines(module: Path, name: str) -> bool:
    src = module.read_text()
    return re.search(rf"^\s*(async\s+)?(def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b[^\n]*\b{name}\b"
                     rf"|^\s+{name},", src, re.M) is not None


def dotted_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists() or base.is_dir():
            rest = parts[i:]
            return not rest or (module.exists() and defines(module, rest[0]))
    return False


def test_every_path_the_docs_name_exists():
    missing = []
    for where, line in doc_lines():
        for m in PATH.finditer(line):
            path = m.group(1).rstrip(".")
            token = re.match(r"[^\s`'\"),;]*", line[m.start():]).group(0)
            if re.search(r"[<>{}*$]", token):
                continue  # a pattern: `templates/<app>/`, `deploy/systemd/gpuportal-{web,...}.service`
            if not (REPO / path).exists():
                missing.append(f"{where}: {path}")
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_every_module_the_docs_name_exists():
    tasks = task_names()
    missing = []
    for where, line in doc_lines():
        for m in DOTTED.finditer(line):
            dotted = m.group(1)
            if re.search(r"\.(py|md|com|org)$", dotted) or dotted in tasks:
                continue
            if not dotted_exists(dotted):
                missing.append(f"{where}: {dotted}")
    assert not missing, "docs name modules or functions that do not exist:\n" + "\n".join(missing)


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
