"""The package layout the contributing guide promises: callbacks are adapters that share a core, never each other."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_tfdebug"


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_callback_module_imports_another_callback_module():
    for path in sorted((PACKAGE / "callbacks").glob("*.py")):
        if path.name == "__init__.py":
            continue
        others = {m for m in imported_modules(path) if m.startswith("lightning_tfdebug.callbacks")}
        assert not others, f"{path.name} imports {sorted(others)}; move what they share to core/ or functional/"


def test_functional_and_core_never_import_callbacks():
    for folder in ("functional", "core"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            bad = {m for m in imported_modules(path) if m.startswith("lightning_tfdebug.callbacks")}
            assert not bad, f"{folder}/{path.name} imports {sorted(bad)}"


def test_functional_modules_need_no_trainer():
    for path in sorted((PACKAGE / "functional").glob("*.py")):
        bad = {m for m in imported_modules(path) if m.startswith(("lightning.pytorch", "pytorch_lightning"))}
        assert not bad, f"functional/{path.name} imports {sorted(bad)}: pure tensor code takes no Trainer"


# ---------------------------------------------------------------------------------------------- the one shape
# Every detector is measure -> reading -> rule -> finding (docs/architecture.md). These tests hold that shape on the
# syntax tree.

MAX_CALLBACK_LINES = 400
MAX_FUNCTION_LINES = 80
CODE = re.compile(r"TFD[1-7]\d\d")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function, and attribute docstrings)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        for before, after in itertools.pairwise(body):
            if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr):
                out.add(id(after.value))
    return out


def codes_written(path: Path) -> set[str]:
    """Finding codes written in a module's code (string constants and f-string parts), docstrings excepted."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    return {
        code
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        for code in CODE.findall(node.value)
    }


def long_functions() -> dict[str, int]:
    """``module:qualname`` of every function over MAX_FUNCTION_LINES lines, with its length."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()

        def visit(node: ast.AST, prefix: str, name: str = name) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qual = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > MAX_FUNCTION_LINES:
                        out[f"{name}:{qual}"] = child.end_lineno - child.lineno + 1
                    visit(child, qual + ".", name)

        visit(ast.parse(path.read_text()), "")
    return out


def impurities(path: Path) -> list[str]:
    """What makes a functional module more than host numbers and tensors in, readings or verdicts out."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg in ("trainer", "pl_module"):
            found.append(f"a `{node.arg}` parameter (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__":
            found.append(f"`__dict__` (line {node.lineno})")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
            found.append(f"file I/O (line {node.lineno})")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for name in names:
                if name.split(".")[0] in ("os", "lightning", "pytorch_lightning", "subprocess", "resource"):
                    found.append(f"imports {name} (line {node.lineno})")
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in it (a function-local import is still a dependency),
    except under ``if TYPE_CHECKING:``."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(name.split(".")[: len(name.split(".")) - node.level] + ([base] if base else []))
                candidates = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                candidates = [a.name for a in node.names]
            deps.update(c for c in candidates if c in modules and c != name and c != "lightning_tfdebug")
        graph[name] = deps
    return graph


def cycles() -> set[frozenset[str]]:
    """The strongly connected groups of modules in the import graph (Tarjan), as sets of two or more modules."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: set[frozenset[str]] = set()

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.add(frozenset(group))

    for v in graph:
        if v not in index:
            connect(v)
    return out


def test_no_callback_writes_a_finding_code():
    """A code is decided by a rule in functional/*_checks.py; a callback only hands verdicts to `emit`."""
    for path in sorted((PACKAGE / "callbacks").glob("*.py")):
        codes = codes_written(path)
        assert not codes, f"callbacks/{path.name} writes {sorted(codes)}: decide them in a rule of functional/"


def test_callbacks_are_small():
    for path in sorted((PACKAGE / "callbacks").glob("*.py")):
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_CALLBACK_LINES, f"callbacks/{path.name} is {lines} lines (at most {MAX_CALLBACK_LINES})"


def test_no_function_is_long():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_functional_is_pure():
    """functional/: tensors and host numbers in, readings or verdicts out: no Trainer, no `__dict__`, no I/O."""
    for path in sorted((PACKAGE / "functional").glob("*.py")):
        found = impurities(path)
        assert not found, f"functional/{path.name}: {found}; move it to core/ (host readers: core/host.py)"


def test_no_import_cycles():
    found = cycles()
    assert not found, f"import cycles: {[sorted(g) for g in found]}"


def test_findings_reach_the_user_through_the_one_emit_path():
    """Only ``DebugCallback`` builds a ``Finding``; every other module hands verdicts to ``emit``."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("findings.py", "base.py", "report.py"):
            continue  # the record itself, the one emit path, and the reader of findings files
        tree = ast.parse(path.read_text())
        built = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Finding"]
        assert not built, f"{path.relative_to(PACKAGE)} builds a Finding at lines {built}: return a verdict instead"


def test_the_layout_checks_see_what_they_check():
    """The scanners find what they look for (a check that cannot fail is no check)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        bad = Path(folder) / "bad.py"
        bad.write_text(
            '"""TFD301 in a docstring is fine."""\n'
            "import os\n\n\ndef f(trainer):\n"
            '    """TFD302 too."""\n'
            "    trainer.__dict__['x'] = open('f')\n"
            '    return "TFD303 " + f"{trainer} TFD304"\n'
        )
        assert codes_written(bad) == {"TFD303", "TFD304"}
        assert len(impurities(bad)) == 4
