"""MaskProbe's rules on the order of a model that reads no token ids or returns one output per sequence: whether the
recorded call can see order at all (permuting its input positions permutes its per-position outputs, or leaves its
per-sequence outputs unchanged: no position information reaches it), measured at the first probe, and how much that
harms the run, decided later from the objective (``TFD215`` at warning or error, ``TFD218`` as info); whether its
per-position outputs are causal or bidirectional (a reading for Coverage, no finding).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from lightning_tfdebug.callbacks.mask_probe.position_checks import TFD215
from lightning_tfdebug.callbacks.mask_probe.readings import CONTENT, ORDER, Number, Reading
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key

DECIDE_STEP = 100
"""The step by which the harm of an order-blind model is decided (the fit's last step when it ends earlier)."""
EARLY_STEPS = 5
"""The first steps whose returned losses are the reference the later ones must fall below."""
LATE_STEPS = 10
"""The steps up to the decision step whose returned losses are compared against the first ones."""
MIN_LOSS_STEPS = 20
"""A decision step earlier than this cannot tell a loss that does not fall: the loss is not judged."""
FALL = 0.9
"""The loss has fallen when the mean of the late steps' losses is below this fraction of the first steps' mean."""


@dataclass(frozen=True)
class OrderSeenReading(Reading):
    """The recorded call with its free positions permuted (``order_change``: per-position outputs against the original
    outputs permuted alike, or per-sequence outputs against the originals) and their values replaced by another row's
    (``content_change``), on ``length`` positions of which ``free`` were moved; ``labels_need_order``: a row holds the
    same inputs at two positions with different labels (None: no per-position labels), at ``pair`` (row, i, j)."""

    order_change: Number
    content_change: Number
    tolerance: Number
    per_position: bool
    length: int
    free: int
    inputs: str
    labels_need_order: Number | None = None
    pair: tuple[Number, Number, Number] | None = None
    LOGGED: ClassVar[Mapping[str, Key]] = {"order_change": ORDER, "content_change": CONTENT}

    @property
    def blind(self) -> bool | None:
        """True: the model cannot see order; False: it can; None: undecided (the content hardly moves the outputs, or
        the order moves them a little). Host numbers only."""
        if self.order_change > 10 * self.tolerance:
            return False
        if self.order_change <= self.tolerance and self.content_change > 10 * self.tolerance:
            return True
        return None


@dataclass(frozen=True)
class CausalKindReading(Reading):
    """A late position's inputs replaced by another row's: the largest change of the outputs before it (``before``) and
    at it (``at``)."""

    before: Number
    at: Number
    tolerance: Number
    position: int

    @property
    def kind(self) -> str | None:
        """``"causal"``, ``"bidirectional"``, or None when the change at the position itself is too small to tell."""
        if self.before > 10 * self.tolerance:
            return "bidirectional"
        if self.before <= self.tolerance and self.at > 10 * self.tolerance:
            return "causal"
        return None


@dataclass(frozen=True)
class LossTrend:
    """The mean returned loss of the first ``early_steps`` steps and of the ``late_steps`` steps up to ``step``."""

    early: float
    late: float
    early_steps: int
    late_steps: int
    step: int

    @property
    def fell(self) -> bool | None:
        """Whether the loss fell (None: too few steps to tell, or a loss that is not a finite positive number)."""
        if self.step < MIN_LOSS_STEPS or not self.early > 0 or not math.isfinite(self.late):
            return None
        return self.late < FALL * self.early


_ORDER_BLIND = (
    "The model cannot see order: permuting {free} of the {length} positions of its inputs ({inputs}) {outcome} "
    "(largest change {order_change:.3g}, tolerance {tolerance:.2g}) while replacing them moved them by "
    "{content_change:.3g}. {harm} No position information reaches the model."
)


def _harm(blind: OrderSeenReading, trend: LossTrend | None) -> str:
    parts = []
    if blind.labels_need_order and blind.pair is not None:
        row, i, j = (int(v) for v in blind.pair)
        parts.append(
            f"The task needs order: row {row} holds the same inputs at positions {i} and {j} with different labels, "
            "which only their positions can tell apart."
        )
    if trend is not None and trend.fell is False:
        parts.append(
            f"The loss has not fallen: {trend.late:.3g} over the {trend.late_steps} steps to step {trend.step} against "
            f"{trend.early:.3g} over the first {trend.early_steps}."
        )
    return " ".join(parts)


TFD218 = Rule(
    "TFD218",
    "info",
    "MaskProbe",
    title="the model cannot see order, and its objective does not need it (a set model)",
    headline="the model cannot see order; its loss fell from {loss_early:.3g} to {loss_late:.3g}",
    trigger=(
        "the recorded call's outputs do not follow the order of its inputs (`TFD215`'s probe), while no per-position "
        "labels need order and the loss fell (or the fit is too short to tell)"
    ),
    details=(
        f"Info. Measured at the first probe as for `TFD215`; decided at step {DECIDE_STEP} (or the fit's last step): "
        "no row holds the same inputs at two positions with different labels, and the mean returned loss of the "
        f"{LATE_STEPS} steps up to the decision step is below {FALL} x that of the first {EARLY_STEPS} steps (with a "
        f"decision step before {MIN_LOSS_STEPS}, the loss is not judged)."
    ),
    hint=(
        "Nothing to do for a model of sets. If the order of the inputs matters to the task, add position information "
        "(a position table or rotary embeddings)."
    ),
    reason="An observation: a model that cannot see order is right for sets and harmless while it trains well",
    message=(
        "The model cannot see order: permuting {free} of the {length} positions of its inputs ({inputs}) {outcome} "
        "(largest change {order_change:.3g}, tolerance {tolerance:.2g}). {trained} Right for a model of sets; if order "
        "matters to the task, add position information."
    ),
)


def decide_order_blind(blind: OrderSeenReading, trend: LossTrend | None) -> Verdict:
    """``TFD215`` for an order-blind model whose objective needs order (per-position labels that differ at identical
    inputs: ``error`` with a loss that did not fall, else ``warning``; a loss that did not fall alone: ``warning``),
    else ``TFD218`` (info)."""
    outcome = "permuted its outputs alike" if blind.per_position else "left its outputs unchanged"
    labels = bool(blind.labels_need_order)
    stalled = trend is not None and trend.fell is False
    evidence = {
        "order_change": blind.order_change,
        "content_change": blind.content_change,
        "tolerance": blind.tolerance,
        "length": blind.length,
        "free": blind.free,
        "inputs": blind.inputs,
        "labels_need_order": labels,
    }
    if trend is not None:
        evidence |= {"loss_early": trend.early, "loss_late": trend.late, "decided_at": trend.step}
    if labels or stalled:
        severity = "error" if labels and stalled else "warning"
        message = _ORDER_BLIND.format(**evidence, outcome=outcome, harm=_harm(blind, trend))
        return TFD215.verdict(evidence, severity=severity, message=message, key="any inputs")
    if trend is not None and trend.fell:
        trained = f"Its loss fell from {trend.early:.3g} to {trend.late:.3g} by step {trend.step}."
    else:
        read = "no row's labels need it" if blind.labels_need_order is not None else "no per-position labels to read"
        trained = f"The fit was too short to tell whether the task needs order ({read})."
    return TFD218.verdict(evidence, outcome=outcome, trained=trained)


BLOCK = ("TFD201", "TFD219")
"""The codes reserved for MaskProbe's rules."""

RULES: tuple[Rule, ...] = (TFD218,)
"""The rules decided in this module, in code order."""
