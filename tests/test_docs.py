"""The docs are part of the contract: every finding code, callback and YAML snippet is documented."""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lightning_tfdebug
from lightning_tfdebug import DebugCallback
from lightning_tfdebug.rules import RULES

ROOT = Path(__file__).resolve().parents[1]


def snake(name: str) -> str:
    name = name.replace("NaN", "Nan")  # NaNFirstFrame -> nan_first_frame
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def public_callbacks():
    return [
        n
        for n in lightning_tfdebug.__all__
        if isinstance(getattr(lightning_tfdebug, n), type)
        and issubclass(getattr(lightning_tfdebug, n), DebugCallback)
        and n != "DebugCallback"
    ]


@pytest.mark.parametrize("name", public_callbacks())
def test_every_callback_has_a_page_with_yaml_keys_and_codes(name):
    page = ROOT / "docs" / "callbacks" / f"{snake(name)}.md"
    assert page.exists(), f"{name} has no docs page at {page.relative_to(ROOT)}"
    text = page.read_text()
    assert f"class_path: lightning_tfdebug.{name}" in text, f"{page.name} lacks a LightningCLI snippet"
    codes = [code for code, rule in RULES.items() if rule.source == name]
    assert codes, f"no rule in lightning_tfdebug.rules names {name} as its source"
    for code in codes:
        assert code in text, f"{page.name} does not mention {code}, which {name} can emit"
    nav = (ROOT / "mkdocs.yml").read_text()
    assert f"callbacks/{snake(name)}.md" in nav
    assert name in (ROOT / "README.md").read_text()


def _class_paths(node):
    """Every ``{class_path, init_args}`` mapping inside a parsed YAML document."""
    if isinstance(node, dict):
        if "class_path" in node:
            yield node["class_path"], node.get("init_args") or {}
        for value in node.values():
            yield from _class_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from _class_paths(value)


def test_yaml_snippets_in_the_docs_parse_and_name_real_arguments():
    """Every YAML block parses; every ``class_path`` of ours names a public class, and every ``init_args`` key one of
    its constructor's arguments (a renamed argument fails here before it fails a user's LightningCLI)."""
    checked = 0
    for page in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S):
            for class_path, init_args in _class_paths(yaml.safe_load(block)):
                if not class_path.startswith("lightning_tfdebug."):
                    continue
                cls = getattr(lightning_tfdebug, class_path.rsplit(".", 1)[1], None)
                assert isinstance(cls, type), f"{page.name}: {class_path} is not a public class of lightning_tfdebug"
                accepted = inspect.signature(cls.__init__).parameters
                unknown = set(init_args) - set(accepted)
                assert not unknown, f"{page.name}: {class_path} has no argument(s) {sorted(unknown)}"
                checked += 1
    assert checked >= len(public_callbacks()), checked  # at least one snippet per callback was read


def test_changelog_has_an_unreleased_section():
    assert "## [Unreleased]" in (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("name", public_callbacks())
def test_every_callback_has_an_api_reference_page(name):
    page = ROOT / "docs" / "api" / f"{snake(name)}.md"
    assert page.exists(), f"{name} has no API reference page at {page.relative_to(ROOT)}"
    assert f"::: lightning_tfdebug.{name}" in page.read_text(), f"{page.name} does not render {name}'s docstring"
    assert f"api/{snake(name)}.md" in (ROOT / "mkdocs.yml").read_text()


def test_the_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: every page in the nav, no broken link, every docstring parses (griffe)."""
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed (`pip install -e .[docs]`)")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    command = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [*command, "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    built = (tmp_path / "site" / "api" / "batch_guard" / "index.html").read_text()
    assert "input_key" in built and "TFD1" in built  # the constructor arguments and finding codes, from the docstring
