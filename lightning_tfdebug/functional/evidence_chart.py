"""What a rule draws to show its finding: an :class:`EvidenceChart`, declared on the :class:`~.verdicts.Rule`.

The report (``lightning_tfdebug/report/``) draws one chart per warning or error from its rule's declaration: logged
series around the finding's step, series the finding carries in its evidence, numbers of the evidence as lines (a
floor, a threshold) or as bars (per-sample losses). A rule without one gets the run's training loss around its step.

Example:
    >>> chart = EvidenceChart("Did the gradient norm leave its running median?", "L2 norm",
    ...                       logged=("grad_norm/total",), lines=("running_median",), window=40)
    >>> chart.needs()
    ('grad_norm/total', 'running_median')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TRAINING_LOSS = "<training loss>"
"""In :attr:`EvidenceChart.logged`: the run's own training loss (``train/loss``, ``train_loss``, ``loss``, ...), found
by the report among the logged series."""


@dataclass(frozen=True)
class EvidenceChart:
    """One chart that shows why a rule fired: one unit on its value axis, titled with the question it answers.

    Attributes:
        question: the chart's title, the question it answers ("Does the returned loss follow the logits?").
        unit: the unit of the value axis (``nats``, ``ms``, ``L2 norm``; one unit for every series on it).
        logged: logged keys drawn against the step (``Key`` names, ``<placeholders>`` allowed; :data:`TRAINING_LOSS`
            for the run's loss).
        evidence_x: the evidence field holding the steps of ``evidence_y`` (a list).
        evidence_y: evidence fields holding lists of values, one per step of ``evidence_x``.
        lines: evidence fields drawn as horizontal lines (a floor, a median, a limit), labelled with their names.
        bars: an evidence field holding a list or a ``{name: value}`` mapping, drawn as bars (per sample, per rank),
            or several fields holding one number each, one bar per field; a chart with bars draws no step axis.
        bar_value: when each item of ``bars`` is itself a mapping (``{rank: {"step": 3, "phase": ...}}``): the field
            drawn; ``bar_label``: a field added to each bar's label.
        window: steps drawn either side of the finding's step (0: the whole run).
        log_scale: a logarithmic value axis (values spanning decades, such as a gradient norm that explodes).
    """

    question: str
    unit: str
    logged: tuple[str, ...] = ()
    evidence_x: str = ""
    evidence_y: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()
    bars: str | tuple[str, ...] = ""
    bar_value: str = ""
    bar_label: str = ""
    window: int = 0
    log_scale: bool = False

    def __post_init__(self) -> None:
        if not self.question.strip():
            raise ValueError("EvidenceChart: `question` (its title) must not be empty.")
        if not (self.logged or self.evidence_y or self.bars):
            raise ValueError(f"EvidenceChart {self.question!r}: draws nothing (give `logged`, `evidence_y` or `bars`).")
        if bool(self.evidence_x) != bool(self.evidence_y):
            raise ValueError(f"EvidenceChart {self.question!r}: `evidence_x` and `evidence_y` go together.")
        if self.window < 0:
            raise ValueError(f"EvidenceChart {self.question!r}: `window` must be >= 0; got {self.window}.")

    def needs(self) -> tuple[str, ...]:
        """Every logged key and evidence field the chart reads, in declaration order."""
        bars = (self.bars,) if isinstance(self.bars, str) else self.bars
        fields = (*self.logged, self.evidence_x, *self.evidence_y, *self.lines, *bars)
        return tuple(f for f in dict.fromkeys(fields) if f)

    def describe(self) -> str:
        """One line for the rule reference: the question and what is drawn."""
        parts = []
        if self.logged:
            parts.append("logged " + ", ".join(f"`{k}`" for k in self.logged))
        if self.evidence_y:
            parts.append("evidence " + ", ".join(f"`{k}`" for k in self.evidence_y) + f" against `{self.evidence_x}`")
        if self.bars:
            bars = (self.bars,) if isinstance(self.bars, str) else self.bars
            parts.append("bars of " + ", ".join(f"`{k}`" for k in bars))
        if self.lines:
            parts.append("lines at " + ", ".join(f"`{k}`" for k in self.lines))
        where = f", {self.window} steps either side of the finding" if self.window and not self.bars else ""
        return f"{self.question} ({self.unit}): {'; '.join(parts)}{where}"


def evidence_value(evidence: Mapping[str, Any], name: str) -> Any:
    """``evidence[name]``, where ``name`` may reach into a mapping with a dot (``band.low``); None when absent."""
    value: Any = evidence
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value
