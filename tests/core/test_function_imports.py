"""docs/design.md section 2: a function-level import says why it is one (a comment on it, or on the
line above its group of imports); any other import sits at the top of its module."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _catches_import_error(node: ast.Try) -> bool:
    names = []
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names += [getattr(k, "id", "") for k in kinds]
    return bool({"ImportError", "ModuleNotFoundError"} & set(names))


def _function_imports(tree: ast.AST):
    """(line, is under try/except ImportError) of each import inside a function body."""
    def walk(node, in_function, guarded):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                yield child.lineno, guarded
            yield from walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)),
                            guarded or isinstance(child, ast.Try) and _catches_import_error(child))
    yield from walk(tree, False, False)


def _unexplained(path: Path, root: Path = REPO) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for lineno, guarded in _function_imports(ast.parse("\n".join(lines))):
        if guarded:  # the except clause is the reason: an optional module
            continue
        first = lineno - 1  # climb to the first import of this group (blank lines between allowed)
        while first > 0 and (lines[first - 1].strip() == "" or lines[first - 1].lstrip().startswith(("import ", "from "))):
            first -= 1
        above = lines[first - 1].lstrip() if first > 0 else ""
        if not above.startswith("#") and not any("#" in line for line in lines[first:lineno]):
            out.append(f"{path.relative_to(root)}:{lineno}: {lines[lineno - 1].strip()}")
    return out


def test_every_function_level_import_says_why():
    found = []
    for root in ("portal", "scheduler"):
        for path in sorted((REPO / root).rglob("*.py")):
            if "migrations" not in path.parts:
                found += _unexplained(path)
    assert found == [], "move these to the module's top, or say why on the line above:\n" + "\n".join(found)


def test_the_check_finds_an_import_without_a_reason(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    x = 1\n    from os import path\n    return path, x\n\n\n"
                     "def g():\n    # a reason\n    import json\n\n    import re\n    return json, re\n\n\n"
                     "def k():\n    y = 2  # not about the import\n\n    import csv\n    return csv, y\n\n\n"
                     "def h():\n    try:\n        import yaml\n    except ImportError:\n        return None\n    return yaml\n")
    assert _unexplained(probe, tmp_path) == ["probe.py:3: from os import path", "probe.py:18: import csv"]
