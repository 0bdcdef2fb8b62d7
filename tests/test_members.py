"""The pack's one list of members (``lightning_tfdebug.pack.MEMBERS``) and everything a member must have.

Adding a member is one line in ``MEMBERS``; the pack, its presets, the contract suite and the benchmarks read that
list. What a list cannot give (an export, a page, a row in the README, the rule reference) is checked here, so a new
member missing one fails with the place to fill in.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_tfdebug
from lightning_tfdebug.pack import MEMBERS, PRESET_MEMBERS
from lightning_tfdebug.rules import RULES

ROOT = Path(__file__).resolve().parents[1]


def snake(name: str) -> str:
    """``NaNFirstFrame`` -> ``nan_first_frame``: a member's module (``callbacks/<snake>``) and page name."""
    return MEMBERS[name].__module__.split(".")[2]


def test_the_list_is_what_the_pack_runs():
    assert len(MEMBERS) >= 13 and all(name == cls.__name__ for name, cls in MEMBERS.items())
    assert set(PRESET_MEMBERS["full"]) == set(MEMBERS)
    assert snake("NaNFirstFrame") == "nan_first_frame" and snake("GradNormMonitor") == "grad_norm_monitor"
    assert all(cls.__module__.startswith("lightning_tfdebug.callbacks.") for cls in MEMBERS.values())


@pytest.mark.parametrize("name", list(MEMBERS))
def test_every_member_has_what_a_user_reaches(name):
    cls = MEMBERS[name]
    assert name in lightning_tfdebug.__all__ and getattr(lightning_tfdebug, name) is cls, "export it in __init__.py"
    page = ROOT / "docs" / "callbacks" / f"{snake(name)}.md"
    assert page.is_file(), f"write {page.relative_to(ROOT)}"
    text = page.read_text()
    assert f"<!-- keys:{name} -->" in text or not cls.KEYS, f"{page.name}: add the keys region"
    assert f"callbacks/{snake(name)}.md" in (ROOT / "mkdocs.yml").read_text(), "add the page to mkdocs.yml's nav"
    assert re.search(rf"^\| `{name}` \|", (ROOT / "README.md").read_text(), re.M), "add a row to README's table"
    owned = [code for code, rule in RULES.items() if rule.source == name]
    if owned:
        assert f"<!-- rules:{name} -->" in text, f"{page.name}: add the rules region"
        assert f"<!-- rules:{name}:detail -->" in (ROOT / "docs" / "findings.md").read_text(), "docs/findings.md"
    assert cls.__doc__ and "class_path" in cls.__doc__, "its docstring shows its LightningCLI YAML"
