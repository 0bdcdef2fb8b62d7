"""The report's pictures, as SVG (:mod:`.svg`): each warning's or error's evidence chart (what its rule's
:class:`~lightning_tfdebug.functional.evidence_chart.EvidenceChart` names, or the training loss around its step),
the run's loss with every warning and error marked, and every logged series grouped by unit.

A chart whose series were not logged (another logger, a run too short) says what is missing instead of drawing an
empty axis."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_tfdebug.core.base import CALLBACKS
from lightning_tfdebug.functional.evidence_chart import TRAINING_LOSS, EvidenceChart, evidence_value
from lightning_tfdebug.primitives.keys import declared
from lightning_tfdebug.report import svg
from lightning_tfdebug.report.run import MergedFinding, Run
from lightning_tfdebug.rules import RULES

Series = dict[str, list[tuple[int, float]]]

LOSS_AROUND = EvidenceChart(
    "What did the training loss do around the finding?", "loss", logged=(TRAINING_LOSS,), window=50
)
"""The chart of a rule that declares none."""

_LOSS_TAGS = ("train/loss", "train_loss", "train_loss_step", "train/loss_step", "loss", "training_loss")
_LOSS_FALLBACK = ("per_rank/loss/rank0", "loss_at_init/loss")
_PLACEHOLDER = re.compile(r"<(\w+)>")
FOLD_SERIES_PER_CHART = 10
NO_UNIT = "no unit (norms, ratios, fractions, counts)"
"""The fold's group of the keys declared without a unit."""


@dataclass(frozen=True)
class Figure:
    """One chart as the report embeds it: the SVG, its alt text and its caption."""

    svg: str
    alt: str
    caption: str
    drawn: bool  # False: the chart says what is missing

    @property
    def uri(self) -> str:
        return svg.data_uri(self.svg)


def training_loss(series: Mapping[str, Any]) -> str | None:
    """The tag of the run's training loss among ``series``: ``train/loss``, ``train_loss``, ``loss``, ... or another
    ``train*loss`` tag, else PerRankLogger's rank 0 or LossAtInit's; None when none was logged."""
    for tag in _LOSS_TAGS:
        if tag in series:
            return tag
    for tag in sorted(series):
        if re.match(r"(?i)^train.*loss", tag) and "val" not in tag.lower():
            return tag
    return next((tag for tag in _LOSS_FALLBACK if tag in series), None)


def _pattern(name: str) -> re.Pattern[str]:
    parts, last = [], 0
    for m in _PLACEHOLDER.finditer(name):
        parts += [re.escape(name[last : m.start()]), ".+" if m.group(1).endswith("path") else "[^/]+"]
        last = m.end()
    return re.compile("".join([*parts, re.escape(name[last:])]))


def logged_series(series: Series, name: str) -> Series:
    """The series ``name`` stands for: a logged key (``<placeholders>`` match any name), or the training loss."""
    if name == TRAINING_LOSS:
        tag = training_loss(series)
        return {tag: series[tag]} if tag else {}
    pattern = _pattern(name)
    # a family (`grad_norm/<group>`) leaves out the keys declared by name (`grad_norm/total`, `grad_norm/nonfinite`)
    literal = _literal_keys() if "<" in name else frozenset()
    return {tag: pts for tag, pts in sorted(series.items()) if pattern.fullmatch(tag) and tag not in literal}


def _literal_keys() -> frozenset[str]:
    return frozenset(k.name for cls in CALLBACKS.values() for k in getattr(cls, "KEYS", ()) if "<" not in k.name)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _label(code: str, m: MergedFinding) -> tuple[str, str]:
    return f"{code} at step {m.step}", f"{m.code} ({m.severity}, step {m.step}, {_ranks(m.ranks)})"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def finding_figure(m: MergedFinding, series: Series) -> Figure:
    """The evidence chart of ``m``: its rule's :class:`EvidenceChart`, or :data:`LOSS_AROUND`."""
    registered = RULES.get(m.code)
    spec = registered.chart if registered is not None and registered.chart is not None else LOSS_AROUND
    title = spec.question
    where, caption = _label(m.code, m)
    alt = f"{where}: {title} ({spec.unit})"
    caption = f"{caption}: {title}"
    lines = []
    absent: list[str] = []
    for name in spec.lines:
        value = _number(evidence_value(m.evidence, name))
        if value is None:
            absent.append(f"the evidence field `{name}`")
        else:
            lines.append((value, f"{name} {svg._number(value)}"))
    if spec.bars:
        if isinstance(spec.bars, str):
            bars, label = _bars(evidence_value(m.evidence, spec.bars), spec.bar_value, spec.bar_label), spec.bars
        else:
            bars = _bars({name: evidence_value(m.evidence, name) for name in spec.bars})
            label = ""
        if not bars:
            return _missing(title, alt, caption, [f"the evidence field(s) `{spec.bars}`"], m)
        chart = svg.bar_chart(title, spec.unit, bars, alt=alt, lines=lines, x_label=label)
        return Figure(chart, alt, caption, True)
    drawn: Series = {}
    if spec.evidence_y:
        xs = evidence_value(m.evidence, spec.evidence_x)
        for name in spec.evidence_y:
            ys = evidence_value(m.evidence, name)
            if isinstance(xs, list) and isinstance(ys, list) and len(xs) == len(ys) and ys:
                drawn[name] = [(int(x), float(y)) for x, y in zip(xs, ys) if _number(y) is not None]
            else:
                absent.append(f"the evidence field `{name}`")
    low, high = (m.step - spec.window, max(m.steps) + spec.window) if spec.window else (-math.inf, math.inf)
    for name in spec.logged:
        found = logged_series(series, name)
        if not found:
            absent.append("the training loss" if name == TRAINING_LOSS else f"the logged series `{name}`")
        for tag, points in list(found.items())[:FOLD_SERIES_PER_CHART]:
            kept = [(s, v) for s, v in points if low <= s <= high]
            if kept:
                drawn[tag] = kept
    if not drawn:
        return _missing(title, alt, caption, absent, m)
    marks = [(s, m.code if i == 0 else "") for i, s in enumerate(m.steps[:20])]
    if absent:
        caption += " (not drawn: " + ", ".join(absent) + ")"
    chart = svg.line_chart(title, spec.unit, drawn, alt=alt, marks=marks, lines=lines, log_scale=spec.log_scale)
    return Figure(chart, alt, caption, True)


def _bars(value: Any, field: str = "", label: str = "") -> list[tuple[str, float]]:
    if isinstance(value, Mapping) and field:  # {name: {field: number, label: text}}
        items = [
            (f"{k} ({v.get(label)})" if label and isinstance(v, Mapping) else str(k), _number(evidence_value(v, field)))
            for k, v in value.items()
            if isinstance(v, Mapping)
        ]
    elif isinstance(value, Mapping):
        items = [(str(k), _number(v)) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(str(i), _number(v)) for i, v in enumerate(value)]
    else:
        return []
    return [(k, v) for k, v in items if v is not None]


def _missing(title: str, alt: str, caption: str, absent: Sequence[str], m: MergedFinding) -> Figure:
    what = ", ".join(absent) or "nothing to draw"
    text = (
        f"Not drawn: {what} is missing (logged series are read from the run's TensorBoard event files: a "
        f"TensorBoardLogger writes them; a run that stopped early may not have reached step {m.step + 1})."
    )
    return Figure(svg.missing_chart(title, text, alt), alt, caption + f" (not drawn: {what})", False)


def overview_figure(run: Run, series: Series, merged: Sequence[MergedFinding]) -> Figure:
    """The run's training loss over the whole run, every warning and error marked at its step with its code."""
    title = "How did the training loss go, and where are the findings?"
    alt = "the training loss of the run, with each warning and error marked at its step"
    tag = training_loss(series)
    flagged = [m for m in merged if m.severity != "info"]
    if tag is None:
        text = (
            "Not drawn: no training loss was logged (a `train/loss`, `train_loss` or `loss` series, read from the "
            "run's TensorBoard event files). Findings: "
            + (", ".join(f"{m.code} at step {m.step}" for m in flagged) or "no warning or error")
            + "."
        )
        return Figure(svg.missing_chart(title, text, alt), alt, "Overview: the training loss (not logged)", False)
    marks = [(m.step, m.code) for m in sorted(flagged, key=lambda m: m.step)]
    chart = svg.line_chart(title, "loss", {tag: series[tag]}, alt=alt, marks=marks)
    caption = f"Overview: `{tag}` with {len(marks)} warning(s) and error(s) marked at their steps"
    return Figure(chart, alt, caption, True)


def rank_rows(run: Run, series: Series, merged: Sequence[MergedFinding]) -> list[dict[str, Any]]:
    """One row per rank: its findings by severity, the checks it could not run, its median step time and peak
    memory when PerRankLogger logged them."""
    ranks = sorted(set(run.ranks) | {r for row in run.coverage for r in row.ranks}) or [0]
    rows = []
    for rank in ranks:
        mine = [f for f in run.findings if f.rank == rank]
        step_time = series.get(f"per_rank/step_time_ms/rank{rank}", [])
        memory = series.get(f"per_rank/peak_memory_gib/rank{rank}", [])
        rows.append(
            {
                "rank": rank,
                "error": sum(f.severity == "error" for f in mine),
                "warning": sum(f.severity == "warning" for f in mine),
                "info": sum(f.severity == "info" for f in mine),
                "first_finding_step": min((f.step for f in mine if f.severity != "info"), default=None),
                "could_not_check": sum(dict(row.said).get(rank) == "unknown" for row in run.coverage),
                "step_time_ms": statistics.median(v for _, v in step_time) if step_time else None,
                "peak_memory_gib": max(v for _, v in memory) if memory else None,
            }
        )
    return rows


def series_groups(series: Series) -> list[tuple[str, str, Series]]:
    """Every logged series grouped by unit (and by the chart its key is declared on): ``(title, unit, series)``,
    at most :data:`FOLD_SERIES_PER_CHART` series each (a larger group is split)."""
    keys = [(name, key) for name, cls in CALLBACKS.items() for key in getattr(cls, "KEYS", ())]
    groups: dict[tuple[str, str], Series] = {}
    for tag, points in sorted(series.items()):
        key = declared([k for _, k in keys], tag)
        if key is None:
            unit, chart = "as logged", f"{tag.split('/', 1)[0]} (the model's own)"
        else:
            unit, chart = key.unit or NO_UNIT, key.chart or key.section
        groups.setdefault((unit, chart), {})[tag] = points
    out = []
    for (unit, chart), members in sorted(groups.items()):
        tags = list(members)
        for start in range(0, len(tags), FOLD_SERIES_PER_CHART):
            part = {t: members[t] for t in tags[start : start + FOLD_SERIES_PER_CHART]}
            suffix = f" ({start // FOLD_SERIES_PER_CHART + 1})" if len(tags) > FOLD_SERIES_PER_CHART else ""
            out.append((f"{chart}{suffix}", unit, part))
    return out


def fold_figures(series: Series) -> list[tuple[str, list[Figure]]]:
    """``[(unit, [figure, ...]), ...]``: the charts of :func:`series_groups`, by unit."""
    by_unit: dict[str, list[Figure]] = {}
    for title, unit, members in series_groups(series):
        alt = f"logged series ({unit}): {title}"
        chart = svg.line_chart(title, unit, members, alt=alt)
        by_unit.setdefault(unit, []).append(Figure(chart, alt, f"{title} ({unit})", True))
    return list(by_unit.items())
