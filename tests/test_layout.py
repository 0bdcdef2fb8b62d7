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


def scanned(paths: list[Path], at_least: str) -> list[Path]:
    """``paths``, asserted to hold ``at_least`` (a file name every such scan must see): a scan that finds nothing
    passes vacuously, so every test says what it must have seen."""
    assert any(p.name == at_least for p in paths), f"the scan saw none of its files ({at_least} missing): {paths}"
    return paths


# ---------------------------------------------------------------------------------------------- the layers
# primitives <- functional <- core <- callbacks <- pack: each imports only the layers below it (docs/contributing.md).

LAYER_OF = {"primitives": 0, "functional": 1, "findings": 1, "rules": 1, "core": 2, "callbacks": 3}
"""A module's layer by its first path segment under the package (top-level modules not listed: the top layer)."""

ALLOWED_BELOW = {0: {"primitives"}, 1: {"primitives", "functional", "findings", "rules"}}
"""What the leaf and the pure layer may import of the package."""


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF.get(parts[1], 4) if len(parts) > 1 else 4


def layer_violations(root: Path) -> list[str]:
    """``module imports module`` for every import of the package ``root`` that reaches a layer above or beside
    its own (callbacks: another callback's module; a callback package's pure modules: core or Lightning)."""
    graph, out = import_graph(root), []
    for name, path in _modules(root).items():
        out += [f"{name} imports {dep}" for dep in sorted(graph.get(name, ())) if not _may_import(name, dep)]
        if layer(name) == 3 and _pure_callback_module(name):
            lightning = {m for m in imported_modules(path) if m.split(".")[0] in ("lightning", "pytorch_lightning")}
            out += [f"{name} imports {m}" for m in sorted(lightning)]
    return out


def _may_import(name: str, dep: str) -> bool:
    mine, theirs, parts = layer(name), layer(dep), dep.split(".")
    if mine in ALLOWED_BELOW:  # the leaf and the pure layer: only what they list (the registry: every rule module)
        registry_reads_rules = name.endswith(".rules") and _pure_callback_module(dep)
        return (len(parts) > 1 and parts[1] in ALLOWED_BELOW[mine]) or registry_reads_rules
    if mine == 2:  # core: nothing above it
        return theirs <= 2
    if mine == 3:  # a callback: its own room, and below it (its pure modules: not core)
        if theirs == 3:
            return _callback_unit(name) == _callback_unit(dep)
        return not (_pure_callback_module(name) and theirs == 2)
    return True


def _callback_unit(module: str) -> str:
    """``lightning_tfdebug.callbacks.loss_at_init.phases`` -> ``loss_at_init``: one callback's room."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


ADAPTERS = ("__init__", "callback", "capture")
"""In a callback package, the modules that face Lightning and ``core/`` (the callback, and what it captures from
the run); every other module there is pure."""


def _pure_callback_module(module: str) -> bool:
    parts = module.split(".")
    return len(parts) == 4 and parts[1] == "callbacks" and parts[3] not in ADAPTERS


def test_every_module_imports_only_the_layers_below_it():
    assert scanned(list(_modules(PACKAGE).values()), "calls.py")
    found = layer_violations(PACKAGE)
    assert not found, f"imports across the layers: {found}"


def test_functional_imports_nothing_from_core():
    paths = scanned(sorted((PACKAGE / "functional").rglob("*.py")), "norms.py")
    for path in paths:
        bad = {m for m in imported_modules(path) if m.startswith("lightning_tfdebug.core")}
        assert not bad, f"functional/{path.name} imports {sorted(bad)}: what it needs belongs in primitives/"


def test_functional_modules_need_no_trainer():
    for path in scanned(sorted((PACKAGE / "functional").rglob("*.py")), "norms.py"):
        bad = {m for m in imported_modules(path) if m.startswith(("lightning.pytorch", "pytorch_lightning"))}
        assert not bad, f"functional/{path.name} imports {sorted(bad)}: pure tensor code takes no Trainer"


# ---------------------------------------------------------------------------------------------- the one shape
# Every detector is measure -> reading -> rule -> finding (docs/architecture.md). These tests hold that shape on the
# syntax tree.

MAX_CALLBACK_LINES = 400
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
CODE = re.compile(r"TFD[1-7]\d\d")


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
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


def long_functions(root: Path = PACKAGE) -> dict[str, int]:
    """``module:qualname`` of every function over MAX_FUNCTION_LINES lines, with its length."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()

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


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in it (a function-local import is still a dependency),
    except under ``if TYPE_CHECKING:``. ``from pkg import name`` where ``name`` is no module is an edge to ``pkg``'s
    ``__init__``: a cycle through a package's ``__init__`` (the top one included) is a cycle."""
    modules = _modules(root)
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
            named = [c for c in candidates[:-1] if c in modules] if isinstance(node, ast.ImportFrom) else []
            targets = named if named and len(named) == len(candidates) - 1 else candidates
            deps.update(c for c in targets if c in modules and c != name)
        graph[name] = deps
    return graph


def cycles(root: Path = PACKAGE) -> set[frozenset[str]]:
    """The strongly connected groups of modules in the import graph (Tarjan), as sets of two or more modules."""
    graph = import_graph(root)
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


def adapters(root: Path = PACKAGE) -> list[Path]:
    """The callback modules that face Lightning: ``callbacks/<name>.py`` and a package's ``callback.py``."""
    single = [p for p in sorted((root / "callbacks").glob("*.py")) if p.name != "__init__.py"]
    return single + sorted((root / "callbacks").glob("*/callback.py"))


def pure_modules(root: Path = PACKAGE) -> list[Path]:
    """The modules that take host numbers and tensors and give readings or verdicts: ``primitives/``,
    ``functional/`` and a callback package's modules other than its adapters."""
    out = sorted((root / "primitives").rglob("*.py")) + sorted((root / "functional").rglob("*.py"))
    for package in sorted(p for p in (root / "callbacks").glob("*") if p.is_dir() and p.name != "__pycache__"):
        out += [p for p in sorted(package.glob("*.py")) if p.stem not in ADAPTERS]
    return out


COLLECTIVES = re.compile(
    r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather\w*|broadcast\w*|reduce_scatter\w*|"
    r"gather|scatter|barrier|reduce)\("
)
"""A collective called directly; outside ``core/`` every one goes through the named reduction."""


def direct_collectives(root: Path = PACKAGE) -> dict[str, list[str]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "core":
            continue
        found = COLLECTIVES.findall(path.read_text())
        if found:
            out[path.relative_to(root).as_posix()] = found
    return out


def test_no_callback_writes_a_finding_code():
    """A code is decided by a rule beside its decision; a callback's adapter only hands verdicts to `emit`."""
    for path in scanned(adapters(), "grad_norm_monitor.py"):
        codes = codes_written(path)
        assert not codes, f"{path.relative_to(PACKAGE)} writes {sorted(codes)}: decide them in a rule"


def test_callbacks_are_small():
    for path in scanned(adapters(), "update_ratio.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_CALLBACK_LINES, (
            f"{path.relative_to(PACKAGE)} is {lines} lines (at most {MAX_CALLBACK_LINES})"
        )


def test_no_module_is_over_600_lines():
    """A room a newcomer can hold: every module of the package reads in one sitting."""
    paths = scanned(sorted(PACKAGE.rglob("*.py")), "pack.py")
    long = {p.relative_to(PACKAGE).as_posix(): n for p in paths if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_long():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_pure_modules_are_pure():
    """primitives/, functional/ and a callback package's own modules: tensors and host numbers in, readings or
    verdicts out: no Trainer, no `__dict__`, no I/O."""
    for path in scanned(pure_modules(), "tracking.py"):
        found = impurities(path)
        assert not found, f"{path.relative_to(PACKAGE)}: {found}; move it to core/ (host readers: core/host.py)"


def test_what_crosses_ranks_goes_through_the_named_reduction():
    """No collective outside core/: members declare named fields (`reduce_then`, `reduce_now`, `gather_records`)."""
    found = direct_collectives()
    assert not found, f"direct collectives outside core/: {found}"


def test_no_import_cycles():
    found = cycles()
    assert not found, f"import cycles: {[sorted(g) for g in found]}"


RECORDER = re.compile(r"\b(CallRecorder|record_calls)\(")
STEP_REPLAY = re.compile(r"(?<!def )\b(quiet_training_step|training_step)\(")
ONE_RECORDER = ("core/calls.py", "primitives/calls.py")
"""The step's one recording (core/calls.py) and the recorder it runs (primitives/calls.py, which also defines
``record_calls`` for code that runs a forward itself, outside a Trainer)."""
STEP_REPLAY_ALLOWED = ("core/model.py", "callbacks/nan_first_frame.py")
"""``quiet_training_step`` is defined in core/model.py; NaNFirstFrame replays a step only after its loss or gradients
became non-finite (the run is already broken), to find the first module that produced them."""


def recorders_and_replays(root: Path = PACKAGE) -> dict[str, list[str]]:
    """Modules that start a call recorder of their own, or call ``training_step``, outside the allowed ones."""
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        found = []
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith((">>>", "#")))
        if name not in ONE_RECORDER:
            found += [f"{m} (a recorder of its own)" for m in RECORDER.findall(code)]
        if name not in STEP_REPLAY_ALLOWED:
            found += [f"{m} (replays the step)" for m in STEP_REPLAY.findall(code)]
        if found:
            out[name] = found
    return out


def test_one_call_recorder_and_no_step_replayed():
    """Every member reads the step's one recording of the calls the real ``training_step`` made
    (``core.calls.record_step``), and replays model calls, never the step: the user's step runs once per micro-batch."""
    found = recorders_and_replays()
    assert not found, f"read the step's one recording (core/calls.py record_step) instead: {found}"


EMIT_PATH = ("findings.py", "core/base.py")
"""The record itself (and the reader of findings files) and the one emit path: the only modules that build a Finding."""


def test_findings_reach_the_user_through_the_one_emit_path():
    """Only ``DebugCallback`` builds a ``Finding``; every other module hands verdicts to ``emit``."""
    paths = scanned(sorted(PACKAGE.rglob("*.py")), "base.py")
    assert all((PACKAGE / p).is_file() for p in EMIT_PATH), EMIT_PATH  # an exemption names a file that exists
    for path in paths:
        if path.relative_to(PACKAGE).as_posix() in EMIT_PATH:
            continue
        tree = ast.parse(path.read_text())
        built = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Finding"]
        assert not built, f"{path.relative_to(PACKAGE)} builds a Finding at lines {built}: return a verdict instead"


RULE_DISTANCE = 40
"""Non-blank lines (other rules' declarations not counted) a rule may sit above the first function deciding it."""


def rules_far_from_deciders(path: Path) -> dict[str, str]:
    """Every module-level ``NAME = Rule(...)`` of ``path`` that is not just above the first top-level function or class
    using it (below it, more than RULE_DISTANCE lines above it, or used by none), with where it is."""
    source = path.read_text().splitlines()
    tree = ast.parse("\n".join(source))
    rules = {
        node.targets[0].id: node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", "") == "Rule"
        and isinstance(node.targets[0], ast.Name)
    }
    registry = ("RULES", "BLOCK", "__all__")
    users = [  # functions and classes, and tables a function reads (a rule looked up by kind in a dict)
        n
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef))
        or (
            isinstance(n, (ast.Assign, ast.AnnAssign))
            and getattr(n.targets[0] if isinstance(n, ast.Assign) else n.target, "id", "") not in (*registry, *rules)
        )
    ]
    out = {}
    for name, node in rules.items():
        first = next((u for u in users if any(isinstance(x, ast.Name) and x.id == name for x in ast.walk(u))), None)
        if first is None:
            out[name] = "decided by no function of its module"
            continue
        other = {i for r in rules.values() for i in range(r.lineno, r.end_lineno + 1)}
        gap = sum(1 for i in range(node.end_lineno + 1, first.lineno) if i not in other and source[i - 1].strip())
        if first.lineno < node.lineno or gap > RULE_DISTANCE:
            out[name] = f"line {node.lineno}, its first use at line {first.lineno}"
    return out


def test_every_rule_sits_just_above_the_function_that_decides_it():
    modules = scanned([p for p in sorted(PACKAGE.rglob("*.py")) if "Rule(" in p.read_text()], "grad_checks.py")
    found = {p.relative_to(PACKAGE).as_posix(): far for p in modules if (far := rules_far_from_deciders(p))}
    assert not found, f"rules away from their deciders: {found}"


def _package(root: Path, files: dict[str, str]) -> Path:
    """A throwaway package named like ours under ``root``, with ``files`` (path -> source)."""
    package = root / "lightning_tfdebug"
    for name, source in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return package


def test_the_layout_checks_see_what_they_check(tmp_path):
    """Every scanner finds what it looks for (a check that cannot fail is no check)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""TFD301 in a docstring is fine."""\n'
        "import os\n\n\ndef f(trainer):\n"
        '    """TFD302 too."""\n'
        "    trainer.__dict__['x'] = open('f')\n"
        '    return "TFD303 " + f"{trainer} TFD304"\n'
    )
    assert codes_written(bad) == {"TFD303", "TFD304"}
    assert len(impurities(bad)) == 4
    assert imported_modules(bad) == {"os"}
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    package = _package(
        tmp_path,
        {
            "__init__.py": "from lightning_tfdebug.pack import Pack\n",
            "pack.py": "import lightning_tfdebug.core.base\n",
            "primitives/__init__.py": "",
            "primitives/leaf.py": "from lightning_tfdebug.functional import maths\n",  # the leaf reaching up
            "functional/__init__.py": "",
            "functional/maths.py": "from lightning_tfdebug.core import base\n",  # pure reaching into core
            "core/__init__.py": "",
            "core/base.py": "from lightning_tfdebug import Pack\n" + f"def long():\n{body}\n",  # a cycle via __init__
            "callbacks/__init__.py": "",
            "callbacks/one.py": "from lightning_tfdebug.callbacks.two import callback\n"
            "import torch.distributed as dist\ndist.all_reduce(x)\n",
            "callbacks/two/__init__.py": "",
            "callbacks/two/callback.py": "from lightning_tfdebug.core import base\n",  # an adapter: allowed
            "callbacks/two/rules.py": "import lightning.pytorch\nfrom lightning_tfdebug.core import base\n",
        },
    )
    assert scanned([bad], "bad.py") and not _raises_nothing(lambda: scanned([], "bad.py"))
    assert sorted(layer_violations(package)) == [
        "lightning_tfdebug.callbacks.one imports lightning_tfdebug.callbacks.two.callback",
        "lightning_tfdebug.callbacks.two.rules imports lightning.pytorch",
        "lightning_tfdebug.callbacks.two.rules imports lightning_tfdebug.core.base",
        "lightning_tfdebug.core.base imports lightning_tfdebug",  # the top package is the top layer
        "lightning_tfdebug.functional.maths imports lightning_tfdebug.core.base",
        "lightning_tfdebug.primitives.leaf imports lightning_tfdebug.functional.maths",
    ]
    assert cycles(package) == {
        frozenset({"lightning_tfdebug", "lightning_tfdebug.pack", "lightning_tfdebug.core.base"})
    }
    assert long_functions(package) == {"core/base.py:long": MAX_FUNCTION_LINES + 1}
    assert [p.name for p in adapters(package)] == ["one.py", "callback.py"]
    assert [p.relative_to(package).as_posix() for p in pure_modules(package)] == [
        "primitives/__init__.py",
        "primitives/leaf.py",
        "functional/__init__.py",
        "functional/maths.py",
        "callbacks/two/rules.py",
    ]
    assert direct_collectives(package) == {"callbacks/one.py": ["all_reduce"]}
    own = _package(
        tmp_path / "own",
        {
            "callbacks/probe.py": "rec = CallRecorder(model).start()\nout = quiet_training_step(m, b, 0)\n",
            "core/calls.py": "rec = CallRecorder(model)\n",  # the one recording: allowed
            "callbacks/doc.py": "# CallRecorder(model) in a comment\n",
        },
    )
    assert recorders_and_replays(own) == {
        "callbacks/probe.py": ["CallRecorder (a recorder of its own)", "quiet_training_step (replays the step)"]
    }
    rules = tmp_path / "rules.py"
    filler = "\n".join(f"X{i} = {i}" for i in range(RULE_DISTANCE + 1))
    rules.write_text(
        "NEAR = Rule('a')\nFAR = Rule('b')\nLOST = Rule('c')\n"
        f"def near():\n    return NEAR\n{filler}\ndef far():\n    return FAR\n"
        "LATE = Rule('d')\n"
        "def early():\n    return None\n"
    )
    assert set(rules_far_from_deciders(rules)) == {"FAR", "LOST", "LATE"}


def _raises_nothing(call) -> bool:
    try:
        call()
    except AssertionError:
        return False
    return True
