"""The logged-key schema: every scalar a callback logs, declared once on the callback class.

The docs' key tables (``scripts/gen_rule_docs.py``), the dashboard's charts, the report's groups and
``tests/test_scalars.py`` are all derived from a callback's ``KEYS``.

Example:
    >>> key = Key("grad_norm/<group>", "L2 norm over one group", chart="gradient norm per block")
    >>> key.matches("grad_norm/blocks.0"), key.matches("grad_norm/a/b")
    (True, False)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_PLACEHOLDER = re.compile(r"<(\w+)>")


@dataclass(frozen=True)
class Key:
    """One logged scalar, or a family of them.

    Attributes:
        name: the key as logged; ``<group>``-style placeholders stand for a name read at run time (a parameter group,
            a layer, a rank) and match any text without a ``/`` (``<...>`` at the end matches the rest, ``/``
            included, when written ``<...path>``).
        description: what the value means (the docs table's "meaning").
        unit: the value's unit (``ms``, ``tokens/s``, ``GiB``; empty for a ratio or a count).
        chart: the dashboard chart the key is drawn on (keys with the same chart share it); empty: not charted.
    """

    name: str
    description: str
    unit: str = ""
    chart: str = ""

    def __post_init__(self) -> None:
        if not self.name or "/" not in self.name:
            raise ValueError(f"A logged key is `section/name`; got {self.name!r}.")
        if not self.description.strip():
            raise ValueError(f"Key {self.name!r}: the description must not be empty.")

    @property
    def section(self) -> str:
        """The TensorBoard section (the text before the first ``/``)."""
        return self.name.split("/", 1)[0]

    def pattern(self) -> str:
        """A regular expression matching every key this declaration stands for."""
        out, last = [], 0
        for m in _PLACEHOLDER.finditer(self.name):
            out.append(re.escape(self.name[last : m.start()]))
            out.append(".+" if m.group(1).endswith("path") else "[^/]+")
            last = m.end()
        out.append(re.escape(self.name[last:]))
        return "".join(out)

    def matches(self, logged: str) -> bool:
        return re.fullmatch(self.pattern(), logged) is not None


def declared(keys: Iterable[Key], logged: str) -> Key | None:
    """The first declaration in ``keys`` that ``logged`` matches, a literal name before a placeholder one."""
    keys = sorted(keys, key=lambda k: "<" in k.name)
    return next((k for k in keys if k.matches(logged)), None)


def render_key_table(keys: Iterable[Key]) -> str:
    """The markdown table of a callback's logged keys: ``key | unit | meaning``."""
    lines = ["| key | unit | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{k.name}` | {k.unit or '-'} | {k.description.replace('|', chr(92) + '|')} |" for k in keys]
    return "\n".join(lines) + "\n"
