"""The rule registry: every finding code the pack can emit, collected from the ``RULES`` of each
``functional/<area>_checks.py`` (where each rule is declared beside the function that decides it).

The tables in ``docs/findings.md`` and on each callback's page are generated from :data:`RULES` by
``python scripts/gen_rule_docs.py``. How to add a rule: ``docs/architecture.md``.

Example:
    >>> from lightning_tfdebug.rules import RULES
    >>> RULES["TFD312"].source, RULES["TFD312"].severity
    ('UpdateRatio', 'error')
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from lightning_tfdebug.callbacks.batch_guard import checks as batch_guard_checks
from lightning_tfdebug.callbacks.loss_at_init import floor_checks as loss_floor_checks
from lightning_tfdebug.callbacks.loss_at_init import init_checks as loss_init_checks
from lightning_tfdebug.callbacks.loss_at_init import stall_checks as loss_stall_checks
from lightning_tfdebug.callbacks.loss_at_init import transform_checks as loss_transform_checks
from lightning_tfdebug.callbacks.mask_probe import (
    alignment_checks,
    leak_checks,
    order_checks,
    padding_checks,
    position_checks,
)
from lightning_tfdebug.findings import set_headline_source
from lightning_tfdebug.functional import (
    activation_checks,
    attention_checks,
    checkpoint_checks,
    grad_checks,
    memory_checks,
    nan_checks,
    optimizer_checks,
    rank_checks,
    repro_checks,
    resume_checks,
    scaler_checks,
    spike_checks,
    stall_checks,
    throughput_checks,
    training_checks,
    update_checks,
)
from lightning_tfdebug.functional.verdicts import Rule

__all__ = [
    "AREAS",
    "BLOCKS",
    "BUILTIN_CODES",
    "RULES",
    "Rule",
    "register_rule",
    "render_chart_table",
    "render_rule_table",
    "rule",
    "rules_of",
]


AREAS: tuple[tuple[str, str], ...] = (
    ("1xx", "data, batches, reproducibility"),
    ("2xx", "masks, positions, targets, the loss"),
    ("3xx", "gradients and optimization"),
    ("4xx", "numerics and precision"),
    ("5xx", "distributed"),
    ("6xx", "throughput and memory"),
    ("7xx", "checkpoint and resume"),
)
"""The hundreds digit of a code names its area."""

_MODULES = (
    batch_guard_checks,
    repro_checks,
    leak_checks,
    padding_checks,
    alignment_checks,
    position_checks,
    order_checks,
    loss_init_checks,
    loss_stall_checks,
    loss_transform_checks,
    loss_floor_checks,
    attention_checks,
    grad_checks,
    update_checks,
    optimizer_checks,
    training_checks,
    activation_checks,
    nan_checks,
    scaler_checks,
    rank_checks,
    stall_checks,
    throughput_checks,
    memory_checks,
    checkpoint_checks,
    resume_checks,
    spike_checks,
)
_RULES: tuple[Rule, ...] = tuple(r for module in _MODULES for r in module.RULES)


def _blocks() -> tuple[tuple[str, str, str], ...]:
    """Each callback's block once, whichever of its rule modules declares it (a callback's rules may be split over
    several modules by what they decide; every module that declares a ``BLOCK`` for it declares the same)."""
    blocks: dict[str, tuple[str, str]] = {}
    for module in _MODULES:
        block = getattr(module, "BLOCK", None)
        if block is None:
            continue
        source = module.RULES[0].source
        if blocks.setdefault(source, tuple(block)) != tuple(block):  # pragma: no cover - a bug in a rule module
            raise RuntimeError(f"lightning_tfdebug.rules: {source}'s rule modules declare different blocks.")
    return tuple((source, first, last) for source, (first, last) in blocks.items())


BLOCKS: tuple[tuple[str, str, str], ...] = _blocks()
"""Each callback's block of codes: ``(source, first, last)``, in documentation order (its rule modules' ``BLOCK``)."""

_REGISTRY: dict[str, Rule] = {r.code: r for r in _RULES}
if len(_REGISTRY) != len(_RULES):  # pragma: no cover - a duplicate code is a bug in this file
    raise RuntimeError("lightning_tfdebug.rules: a code is registered twice.")

RULES: Mapping[str, Rule] = MappingProxyType(_REGISTRY)
"""Every registered rule by code: the pack's own in documentation order, then any added by
:func:`register_rule` (read-only; register through that function)."""

BUILTIN_CODES: frozenset[str] = frozenset(_REGISTRY)
"""The codes of the pack's own rules (those documented in ``docs/findings.md``)."""


def _headline_of(code: str, evidence: Mapping[str, Any]) -> str | None:
    registered = _REGISTRY.get(code)
    return None if registered is None else registered.headline_for(evidence)


set_headline_source(_headline_of)  # a finding read from an older file, or built without a headline, gets its rule's


def register_rule(new: Rule) -> Rule:
    """Register the rule of a callback built outside the pack on :class:`~lightning_tfdebug.DebugCallback`.

    Registering the same rule twice is allowed (a module imported again); a different rule under a code that is
    taken is not.

    Raises:
        TypeError: if ``new`` is not a :class:`Rule`.
        ValueError: if its code is already registered with different content.
    """
    if not isinstance(new, Rule):
        raise TypeError(f"register_rule takes a Rule; got {type(new).__name__}.")
    existing = _REGISTRY.get(new.code)
    if existing is not None and existing != new:
        raise ValueError(f"Finding code {new.code} is already registered by {existing.source}: {existing.title!r}.")
    _REGISTRY[new.code] = new
    return new


def rule(code: str) -> Rule:
    """The rule of ``code``.

    Raises:
        KeyError: if ``code`` is not registered (a callback emitting an unregistered code is a bug of the pack).
    """
    try:
        return RULES[code]
    except KeyError:
        raise KeyError(
            f"Finding code {code!r} is not in lightning_tfdebug.rules.RULES; register it there before emitting it."
        ) from None


def rules_of(source: str) -> tuple[Rule, ...]:
    """The rules a callback (by class name) can emit, in code order."""
    return tuple(sorted((r for r in _REGISTRY.values() if r.source == source), key=lambda r: r.code))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _paragraph(text: str) -> str:
    """``text`` (a rule's ``details``, possibly wrapped over several source lines) as one markdown list item."""
    return " ".join(text.split())


def render_rule_table(source: str, detail: bool) -> str:
    """The markdown table of ``source``'s rules: ``code | severity | trigger | what to do | why this severity`` when
    ``detail`` (the findings page; the last column is the rule's ``reason`` under ``docs/severity.md``), followed by
    each rule's ``details`` (its exact conditions and thresholds) where it has some, else ``code | severity |
    meaning`` (the callback's own page)."""
    rows = rules_of(source)
    if not rows:
        raise ValueError(f"No rules registered for {source!r}.")
    if detail:
        lines = ["| code | severity | trigger | what to do | why this severity |", "| --- | --- | --- | --- | --- |"]
        lines += [
            f"| {r.code} | {r.severity} | {_cell(r.trigger)} | {_cell(r.hint)} | {_cell(r.reason)} |" for r in rows
        ]
        detailed = [r for r in rows if r.details.strip()]
        if detailed:
            lines += ["", "Exact conditions and thresholds:", ""]
            lines += [f"- **{r.code}**: {_paragraph(r.details)}" for r in detailed]
    else:
        lines = ["| code | severity | meaning |", "| --- | --- | --- |"]
        lines += [f"| {r.code} | {r.severity} | {_cell(r.title)} |" for r in rows]
    return "\n".join(lines) + "\n"


def render_chart_table() -> str:
    """The markdown table of what the report draws for each rule's warning or error: ``code | severity | headline |
    evidence chart``, the chart's question, unit and what it reads (:class:`~.functional.evidence_chart.EvidenceChart`),
    or that the rule has none (the report then draws the training loss around the finding's step)."""
    lines = ["| code | severity | headline | evidence chart |", "| --- | --- | --- | --- |"]
    for r in sorted(_REGISTRY.values(), key=lambda r: r.code):
        if r.code not in BUILTIN_CODES:
            continue
        headline = r.headline if isinstance(r.headline, str) else r.headline[0]
        chart = r.chart.describe() if r.chart is not None else "none of its own: the training loss around its step"
        lines.append(f"| {r.code} | {r.severity} | {_cell(headline or r.title)} | {_cell(chart)} |")
    counted = sum(_REGISTRY[c].chart is not None for c in BUILTIN_CODES)
    lines += ["", f"{counted} of {len(BUILTIN_CODES)} rules draw a chart of their own."]
    return "\n".join(lines) + "\n"
