"""Write the findings and logged-key tables of the docs from the rule registry and the callbacks' ``KEYS``.

Usage::

    python scripts/gen_rule_docs.py          # rewrite docs/findings.md and docs/callbacks/*.md tables
    python scripts/gen_rule_docs.py --check  # exit 1, naming the files, when the docs drifted from the registry

Only the regions between ``<!-- rules:<Source>[:detail] -->`` and ``<!-- /rules -->`` (a callback's findings) and
between ``<!-- keys:<Source> -->`` and ``<!-- /keys -->`` (its logged keys, from the class's ``KEYS``) and
between ``<!-- charts -->`` and ``<!-- /charts -->`` (each rule's headline and evidence chart, in
``docs/report.md``) are written; the prose around them is hand-written. ``docs/findings.md`` holds each callback's
detailed table (trigger, what to do, and why the rule has its severity: the rule's ``reason`` under the policy of
``docs/severity.md``), each callback's page its short table (meaning). ``tests/test_rules.py`` runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import lightning_tfdebug
from lightning_tfdebug.primitives.keys import render_key_table
from lightning_tfdebug.rules import BLOCKS, render_chart_table, render_rule_table

ROOT = Path(__file__).resolve().parent.parent
_REGION = re.compile(r"(<!-- rules:(\w+)(:detail)? -->\n)(.*?)(<!-- /rules -->)", re.S)
_KEYS = re.compile(r"(<!-- keys:(\w+) -->\n)(.*?)(<!-- /keys -->)", re.S)
_CHARTS = re.compile(r"(<!-- charts -->\n)(.*?)(<!-- /charts -->)", re.S)


def page_of(source: str) -> Path:
    """The docs page of a callback, named after its module or package under ``callbacks/``
    (``docs/callbacks/batch_guard.md``)."""
    module = getattr(lightning_tfdebug, source).__module__.split(".")[2]
    return ROOT / "docs" / "callbacks" / f"{module}.md"


def render(text: str) -> str:
    """``text`` with every rules region filled from the registry."""
    text = _REGION.sub(lambda m: m.group(1) + render_rule_table(m.group(2), detail=bool(m.group(3))) + m.group(5), text)
    text = _KEYS.sub(
        lambda m: m.group(1) + render_key_table(getattr(lightning_tfdebug, m.group(2)).KEYS) + m.group(4), text
    )
    return _CHARTS.sub(lambda m: m.group(1) + render_chart_table() + m.group(3), text)


def regions(text: str) -> list[tuple[str, bool]]:
    """The ``(source, detail)`` of every rules region in ``text``."""
    return [(m.group(2), bool(m.group(3))) for m in _REGION.finditer(text)]


def targets() -> list[Path]:
    return [ROOT / "docs" / "findings.md", ROOT / "docs" / "report.md", *(page_of(source) for source, _, _ in BLOCKS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for path in targets():
        text = path.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"docs drifted from lightning_tfdebug.rules: {names}; run python scripts/gen_rule_docs.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
