"""The package layout the contributing guide promises: callbacks are adapters that share a core, never each other."""

from __future__ import annotations

import ast
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
