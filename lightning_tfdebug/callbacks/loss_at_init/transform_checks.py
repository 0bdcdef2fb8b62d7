"""LossAtInit's transform fits, without a Trainer: the loss ``training_step`` returned against the recorded logits'
own cross-entropy on the compared steps and the check: a bound pins it (``TFD233``), a temperature (``TFD234``), or
an unexplained difference (``TFD235``); label smoothing is named (``TFD237``, :mod:`.floor_checks`); a soft-cap that
binds nothing, a constant factor or a small added term pass; a loss below every cross-entropy of these logits is none
of theirs (:func:`not_cross_entropy`: the comparison stands aside). Measured values:
``docs/callbacks/loss_at_init.md``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from lightning_tfdebug.callbacks.loss_at_init.floor_checks import (
    SMOOTHING_MISS,
    named_smoothing,
    smoothing_fit,
    smoothing_verdict,
    width_floor,
)
from lightning_tfdebug.callbacks.loss_at_init.readings import LossReading, _at, _roots
from lightning_tfdebug.callbacks.loss_at_init.stall_checks import FLOOR_ABOVE_DATA
from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.loss import CAP_GRID, TEMPERATURE_GRID, uniform_loss
from lightning_tfdebug.functional.verdicts import Rule, Verdict

# the returned loss against the logits' own cross-entropy (measured values: docs/callbacks/loss_at_init.md)
AGREE = 0.03
"""The returned loss agrees with the logits' cross-entropy within this fraction (or three standard errors)."""


PINNED_FALL = 0.04
"""A bound pins the loss: it fell by at most this fraction of itself over the compared steps ..."""


LOSS_FOLLOWS = 0.5
"""... or by less than this fraction of the logits' own cross-entropy's fall ..."""


PINNED_GAP = 0.1
"""... and sits this fraction of ln(V) above what the logits reach at their best temperature ..."""


RANGE_GROWTH = 0.1
"""... while the logits' range grew by at least this fraction (a squash keeps pushing its input outwards)."""


FAR_ABOVE = 0.1
"""TFD233 without a floor: the loss is above the logits' cross-entropy by this fraction of ln(V) and ADDED_TERM."""


MAX_SMOOTHING = 0.3
"""Label smoothing (:func:`~.floor_checks.smoothing_fit`) above this ``eps`` must also give the loss within
:data:`~.floor_checks.SMOOTHING_MISS` (a soft-cap far too small mimics a steady ``e`` of 0.35 to 0.5)."""


TEMPERATURE_MATCH = 0.03
"""A temperature: one multiplier ``b = 1/T`` gives the loss at every compared step within this fraction ..."""


TEMPERATURE_MIN = math.log(1.25)
"""... and ``|ln b|`` is at least this."""


SCALE_SPREAD = math.log(1.1)
"""A constant factor (``loss / k`` for manual accumulation): ``loss / ce`` varies by at most 10%."""


ADDED_TERM = 0.2
"""An added term (z-loss, auxiliary loss) lifts the loss above the logits' cross-entropy by at most this fraction."""


ADDED_FOLLOWS = 0.9
"""A larger added term is told from a bound by the loss falling with the logits' cross-entropy: this fraction of it."""


_TRANSFORM_HEAD = (
    "From step {first_step} to step {last_step} the loss training_step returned ({returned}) is not the cross-entropy "
    "of the model's logits ({logits_ce})"
)
"""The first sentence of ``TFD233``-``TFD235``."""


TFD233 = Rule(
    "TFD233",
    "warning",
    "LossAtInit",
    title="the returned loss stays far above the logits' own cross-entropy: a bound or squash before the loss",
    headline=(
        "the loss trains squashed logits (cap c = {cap:.3g}, floor {floor:.2f} nats)",
        "the loss trains bounded outputs (floor {floor:.2f} nats, width w = {width:.2f})",
        "the returned loss stays {gap:.3g} nats above the logits' own cross-entropy",
    ),
    chart=EvidenceChart(
        "Does the returned loss follow the logits' own cross-entropy?",
        "nats",
        evidence_x="steps",
        evidence_y=("returned_loss", "logits_loss"),
        lines=("floor", "unigram_entropy"),
    ),
    trigger=(
        "on every compared step (at least two) the returned loss is above the recorded logits' cross-entropy by 20% "
        "of it and 10% of ln(V), not explained by label smoothing (at most 0.3) or a temperature, and fell by less "
        "than 0.9x what the cross-entropy fell (an added term such as distillation falls with it); or it is pinned: "
        "it fell by at most 4% while the logits' range grew by 10% (the message then names the width w whose floor "
        "ln(1 + (V-1) e^-w) the loss sits on); or it is the cross-entropy of c * tanh(logits / c) for one c at every "
        "compared step (within 3%, closer than any temperature) and that cap keeps every token below probability 1/2 "
        "or the loss above what the logits reach"
    ),
    details=(
        "On the compared steps (10, 20, 30, 40, the first measuring steps at or after half and three quarters of "
        "`check_step`, and the check; decided once from step 30, then on the check's own window), `L` the returned "
        "loss, `C` the recorded logits' cross-entropy (at most `max_rows` rows, under the alignment the logits "
        "predict best), at least two steps, `L` differing from `C` at every one by more than 3% (and three standard "
        "errors of `C`). Fires, first match wins after label smoothing above 0.3 (`TFD237`): a soft-cap `c "
        "tanh(logits / c)` (grid of 13 `c` from 1/4 to 16) or `sigmoid(logits)` gives `L` within 3% at every step, "
        "closer than any temperature, and its floor `ln(1 + (V-1) e^-2c)` (width 1 for a sigmoid) is above ln 2 or "
        "above what the logits reach at their best temperature; or the loss is pinned: above `C` at every step, fell "
        "by at most 4% of itself or by less than half of `C`'s fall, at least 10% of ln(V) above the logits' "
        "best-temperature loss and 5% of ln(V) above the unigram entropy, below ln(V), while the logits' range grew "
        "by 10% (the message names the width `w`); or, when no temperature fits, `L` is above `C` at every step by "
        "more than 20% of `C` and 10% of ln(V) and fell by less than 0.9x what `C` fell (when `C` fell by 3%)."
    ),
    hint=(
        "Give the loss the raw logits: remove the sigmoid, soft-cap c * tanh(logits / c) with c too small, clamp or "
        "normalisation in training_step or the loss module, or apply it only where probabilities are needed."
    ),
    reason="Measured: the minimised loss stays far above what the model's own logits give; training cannot close it",
    message=_TRANSFORM_HEAD
    + (
        ": at step {last_step} the loss is {last_loss:.4g}, {gap:.3g} nats above the logits' own {last_ce:.4g}"
        "{detail}. Something between the model's output and the loss squashes or bounds the logits (a sigmoid, tanh, "
        "clamp or normalisation in training_step or a loss wrapper), and the loss trains the squashed logits."
    ),
)


TFD234 = Rule(
    "TFD234",
    "info",
    "LossAtInit",
    title="the returned loss is the cross-entropy of the logits divided by a temperature T",
    trigger=(
        "on every compared step the returned loss differs from the recorded logits' cross-entropy by more than 3% "
        "and equals the cross-entropy of logits / T for one T (within 3%) at all of them, T outside [0.8, 1.25]"
    ),
    details=(
        "On the compared steps (see `TFD233`; at least two, `L` differing from `C` by more than 3% at every one, or "
        "crossing it), no label smoothing or bound fits and the loss is not pinned: one multiplier `b = 1/T` (grid of"
        " 33 from 1/16 to 16) gives `L` within 3% at every step, and `T` is outside [0.8, 1.25]."
    ),
    hint=(
        "If the temperature is deliberate, use the same T wherever the logits are read (evaluation, sampling, a "
        "validation loss); if not, remove the division or multiplication of the logits before the loss."
    ),
    reason="An observation: the run trains; the harm, if any, is in code that reads the logits without the temperature",
    message=_TRANSFORM_HEAD
    + (
        ": it is the cross-entropy of logits / T with T = {temperature:.3g} at every compared step. The loss trains "
        "logits / {temperature:.3g}, so the model's own logits are {temperature:.3g}x {direction} than its "
        "predictions during training: anything that reads them without that temperature (evaluation, sampling, a "
        "validation loss) sees another model."
    ),
)


TFD235 = Rule(
    "TFD235",
    "info",
    "LossAtInit",
    title="the returned loss is not the cross-entropy of the model's logits, and no known transform explains it",
    trigger=(
        "on every compared step the returned loss differs from the recorded logits' cross-entropy by more than "
        "3%, and neither a bound or a loss far above them (TFD233), label smoothing, a temperature (TFD234), a "
        "constant factor nor an added term of at most 20% explains it; the message gives both numbers"
    ),
    details=(
        "On the compared steps (see `TFD233`; at least two), `L` differs from `C` at every one by more than 3% (and "
        "three standard errors), and nothing explains it: not label smoothing (`TFD237`), a bound or a loss far above"
        " (`TFD233`), a temperature (`TFD234`), a constant factor (`L / C` the same within 10%, or equal to the "
        "batch's supervised share of label positions within 10%) nor an added term (`L` above `C` by at most 20% of "
        "`C`). A returned loss below `C` by 3% at every step that no temperature, factor or supervised share explains"
        " is no cross-entropy of the logits: the comparison then stands aside once instead."
    ),
    hint=(
        "Check what training_step does to the logits before the loss, or point `logits_module` at the module "
        "whose output the loss reads."
    ),
    reason="An observation: the disagreement is measured, but no harm to this run is",
    message=_TRANSFORM_HEAD
    + (
        ", and no bound, label smoothing, temperature, constant factor or small added term explains it: at step "
        "{last_step} the returned loss is {last_loss:.4g}, the logits' cross-entropy {last_ce:.4g}."
    ),
)


def loss_transform_verdict(
    readings: Sequence[LossReading], vocab: int, unigram_entropy: float = float("nan")
) -> Verdict | None:
    """``TFD233``-``TFD235``: the returned loss disagrees with the recorded logits' cross-entropy at every compared
    step (at least two), and what explains it. First match wins:

    * it agrees at some step (:data:`AGREE`, or three standard errors of a sampled mean): nothing, unless one
      temperature gives the loss at every step (a model compensating a temperature crosses it on the way);
    * label smoothing (:func:`~.floor_checks.smoothing_fit`): ``TFD237``, a warning when its floor is above half of
      ln(V), else info naming ``eps`` (above :data:`MAX_SMOOTHING` only a close fit, decided first: it pins the loss
      too; up to it, unless the loss is pinned at the floor of a bound, :func:`_pinned`; a steady ``e`` too small or
      too loose to name: nothing);
    * a soft-cap ``c * tanh(logits / c)`` (:func:`_soft_cap`) or a sigmoid (:func:`_sigmoid`) fits every step better
      than any temperature: ``TFD233`` when its floor keeps every token below probability 1/2 or above what the
      logits reach, else nothing;
    * a temperature (:data:`TEMPERATURE_MATCH`, :data:`TEMPERATURE_MIN`): ``TFD234`` (info);
    * the loss pinned (naming the bound's width ``w``), or far above the logits' cross-entropy at every step
      (:func:`_far_above`) and not falling with it (:func:`_follows`: a large added term does): ``TFD233``;
    * a constant factor (:data:`SCALE_SPREAD`) or a small added term (:data:`ADDED_TERM`): nothing;
    * else ``TFD235`` (info) with both numbers.
    """
    points = [r for r in readings if math.isfinite(r.loss) and math.isfinite(r.ce) and r.ce > 0]
    if len(points) < 2:
        return None
    agreeing = [abs(r.loss - r.ce) <= max(AGREE * r.ce, 3.0 * r.ce_error) for r in points]
    if all(agreeing):
        return None  # the loss is the logits' cross-entropy
    first, last = points[0], points[-1]
    expected = uniform_loss(vocab)
    evidence: dict[str, Any] = {
        "steps": [r.step for r in points],
        "returned_loss": [r.loss for r in points],
        "logits_loss": [r.ce for r in points],
        "best_temperature_loss": [r.best for r in points],
        "logit_range": [r.logit_range for r in points],
        "expected_loss": expected,
        "unigram_entropy": unigram_entropy,
    }
    head = {
        "first_step": first.step,
        "last_step": last.step,
        "returned": _series(r.loss for r in points),
        "logits_ce": _series(r.ce for r in points),
        "last_loss": last.loss,
        "last_ce": last.ce,
    }
    smoothing = smoothing_fit(points)
    if smoothing is not None and smoothing[0] > MAX_SMOOTHING and smoothing[1] <= SMOOTHING_MISS:
        return smoothing_verdict(points, smoothing, vocab)  # a large eps pins the loss too: told by its fit
    pinned = not any(agreeing) and _pinned(points, expected, unigram_entropy)
    if not pinned and smoothing is not None and smoothing[0] <= MAX_SMOOTHING:
        # info naming eps (a warning on its floor); a steady e too small or too loose to name: explained, healthy
        return smoothing_verdict(points, smoothing, vocab) if named_smoothing(smoothing) else None
    # a bound whose curve gives the loss (agreeing at a step too: a small cap barely moves small logits) names itself,
    # before a pinned loss's width, which is read off the loss
    fitted, verdict = _fitted_bound(points, vocab, evidence, head)
    if fitted:
        return verdict
    shared = None if pinned else _shared_temperature(points)  # a model compensating T crosses CE(logits / T)
    if shared is not None and abs(math.log(shared)) >= TEMPERATURE_MIN:
        temperature = 1.0 / shared
        direction = "sharper" if temperature > 1 else "flatter"
        return TFD234.verdict(
            {**evidence, "temperature": temperature}, severity="info", step=last.step, direction=direction, **head
        )
    if pinned or (all(_far_above(r, expected) for r in points) and not _follows(points)):
        detail = ""
        if pinned:  # the width whose floor the loss sits on
            evidence.update(width=bound_width(last.loss, vocab), floor=last.loss)
            data = f", above the labels' unigram entropy ({unigram_entropy:.3f})" if unigram_entropy > 0 else ""
            detail = (
                f"; it stays at the floor ln(1 + (V-1) e^-w) of outputs confined to a range of width w = "
                f"{evidence['width']:.2f} (V={vocab}){data}, while the logits reach {last.best:.3f} and their range "
                f"keeps growing ({first.logit_range:.3g} -> {last.logit_range:.3g})"
            )
        return TFD233.verdict(evidence, step=last.step, gap=last.loss - last.ce, detail=detail, **head)
    if any(agreeing) or _explained_difference(points):
        return None
    return TFD235.verdict(evidence, severity="info", step=last.step, **head)


def bound_width(loss: float, vocab: int) -> float:
    """The range width ``w`` whose floor ``ln(1 + (V - 1) e^-w)`` equals ``loss`` (below ln(V))."""
    return math.log((vocab - 1) / math.expm1(loss)) if 0 < loss < math.log(vocab) else float("nan")


def _fitted_bound(
    points: Sequence[LossReading], vocab: int, evidence: dict[str, Any], head: dict[str, Any]
) -> tuple[bool, Verdict | None]:
    """Whether a soft-cap (:func:`_soft_cap`) or a sigmoid (:func:`_sigmoid`) gives the loss, better than any
    temperature does, and its ``TFD233`` when it binds (:func:`_bounded`)."""
    last, cap = points[-1], _soft_cap(points)
    if cap is not None:
        (c, miss), temperature_miss = cap
        found = {**evidence, "cap": c, "cap_miss": miss}
        what = f"c * tanh(logits / c) with c = {c:.3g}"
        return True, _bounded(what, 2.0 * c, miss, temperature_miss, vocab, last, found, head)
    sigmoid = _sigmoid(points)
    if sigmoid is not None:
        miss, temperature_miss = sigmoid
        found = {**evidence, "bound": "a sigmoid", "sigmoid_miss": miss}
        return True, _bounded("sigmoid(logits)", 1.0, miss, temperature_miss, vocab, last, found, head)
    return False, None


def _bounded(
    what: str,
    width: float,
    miss: float,
    temperature_miss: float,
    vocab: int,
    last: LossReading,
    evidence: dict[str, Any],
    head: dict[str, Any],
) -> Verdict | None:
    """``TFD233`` for the bound :func:`_soft_cap` or :func:`_sigmoid` found (``what``, confining the logits to a range
    of width ``width``), when it binds; None when it binds neither the logits nor a prediction of probability 1/2."""
    floor = width_floor(width, vocab)
    if floor <= min(math.log(2.0), last.best):
        return None  # a bound that binds neither the logits nor a prediction of probability 1/2
    evidence.update(temperature_miss=temperature_miss, width=width, floor=floor)
    detail = (
        f"; it is the cross-entropy of {what} at every compared step (largest miss {miss:.2%} of the loss, "
        f"{temperature_miss:.2%} for the best single temperature), and outputs confined to a range of width "
        f"{width:.3g} cannot bring the loss below ln(1 + (V-1) e^-w) = {floor:.3f} (V={vocab}): no token can get "
        f"more than {1.0 / (1.0 + (vocab - 1) * math.exp(-width)):.1%} of the probability, while the logits "
        f"already reach {last.best:.3f}"
    )
    return TFD233.verdict(evidence, step=last.step, gap=last.loss - last.ce, detail=detail, **head)


def _pinned(points: Sequence[LossReading], expected: float, unigram_entropy: float) -> bool:
    """A bound pins the returned loss: above the logits' cross-entropy at every point, it fell by at most
    :data:`PINNED_FALL` of itself or by less than :data:`LOSS_FOLLOWS` of the logits' cross-entropy's fall, stays
    :data:`PINNED_GAP` of ln(V) above the logits' best loss at any temperature and (when known)
    :data:`FLOOR_ABOVE_DATA` of ln(V) above the labels' unigram entropy, below ln(V), while the logits' range grew by
    :data:`RANGE_GROWTH`."""
    first, last = points[0], points[-1]
    above_data = not math.isfinite(unigram_entropy) or last.loss >= unigram_entropy + FLOOR_ABOVE_DATA * expected
    fell = first.loss - last.loss
    return (
        all(r.loss > r.ce for r in points)
        and (fell <= PINNED_FALL * last.loss or fell < LOSS_FOLLOWS * (first.ce - last.ce))
        and all(r.loss - r.best >= PINNED_GAP * expected for r in points)
        and last.logit_range >= (1.0 + RANGE_GROWTH) * first.logit_range
        and above_data
        and last.loss < expected
    )


def _soft_cap(points: Sequence[LossReading]) -> tuple[tuple[float, float], float] | None:
    """``((c, miss), temperature_miss)``: the soft-cap ``c`` whose ``c * tanh(logits / c)`` gives the returned loss at
    every point within :data:`AGREE` of it (``miss``: the largest relative miss), strictly better than the best single
    temperature does (``temperature_miss``, inf when none crosses the loss); None when none does. A temperature and
    a bound both raise the loss above the logits' cross-entropy; only the bound saturates, so the shape of the two
    curves, not one number, tells them apart."""
    if not all(r.cap_ce for r in points):
        return None
    cap = _shared_fit(points, CAP_GRID, lambda r: r.cap_ce)
    if cap is None or cap[1] > AGREE:
        return None
    temperature = _shared_fit(points, TEMPERATURE_GRID, lambda r: r.beta_ce)
    temperature_miss = math.inf if temperature is None else temperature[1]
    return (cap, temperature_miss) if cap[1] < temperature_miss else None


def _sigmoid(points: Sequence[LossReading]) -> tuple[float, float] | None:
    """``(miss, temperature_miss)``: ``sigmoid(logits)`` gives the returned loss at every point within :data:`AGREE`
    of it, strictly better than the best single temperature does (at small logits a sigmoid is a temperature of 4:
    only logits that grew tell them apart); None otherwise."""
    if not all(math.isfinite(r.sigmoid_ce) for r in points):
        return None
    miss = max(abs(r.sigmoid_ce - r.loss) / r.loss for r in points)
    if miss > AGREE:
        return None
    temperature = _shared_fit(points, TEMPERATURE_GRID, lambda r: r.beta_ce)
    temperature_miss = math.inf if temperature is None else temperature[1]
    return (miss, temperature_miss) if miss < temperature_miss else None


def _shared_fit(points: Sequence[LossReading], grid: Sequence[float], curve: Any) -> tuple[float, float] | None:
    """The one parameter on ``grid`` whose curve (``curve(reading)``) gives the returned loss at every point most
    closely, and its largest relative miss; tried at every point's crossings and between neighbouring ones."""
    roots = sorted(root for r in points for root in _roots(grid, curve(r), r.loss))
    candidates = roots + [math.sqrt(a * b) for a, b in itertools.pairwise(roots)]
    best: tuple[float, float] | None = None
    for x in candidates:
        miss = max(abs(_at(grid, curve(r), x) - r.loss) / r.loss for r in points)
        if math.isfinite(miss) and (best is None or miss < best[1]):
            best = (x, miss)
    return best


def _far_above(r: LossReading, expected: float) -> bool:
    """The loss is above the logits' cross-entropy by more than an added term explains: :data:`ADDED_TERM` of it,
    :data:`FAR_ABOVE` of ln(V) and three standard errors of a sampled mean."""
    return r.loss - r.ce > max(ADDED_TERM * r.ce, FAR_ABOVE * expected, 3.0 * r.ce_error)


def _follows(points: Sequence[LossReading]) -> bool:
    """The returned loss fell by at least :data:`ADDED_FOLLOWS` of what the logits' own cross-entropy fell (which fell
    by at least :data:`AGREE` of itself): a term added beside the cross-entropy (distillation, an auxiliary loss) trains
    with it, while a bound or squash keeps the loss from following the logits (0.18 to 0.6 of their fall measured)."""
    first, last = points[0], points[-1]
    ce_fall = first.ce - last.ce
    return ce_fall >= AGREE * first.ce and first.loss - last.loss >= ADDED_FOLLOWS * ce_fall


def _explained_difference(points: Sequence[LossReading]) -> bool:
    """A constant factor (``loss / k`` for manual accumulation), a sum over the supervised tokens divided by every
    label position (padding included), or a small added term (z-loss, auxiliary loss)."""
    ratios = [r.loss / r.ce for r in points]
    if min(ratios) <= 0:
        return False
    if math.log(max(ratios) / min(ratios)) <= SCALE_SPREAD:
        return True
    if all(abs(math.log(q / r.supervised_share)) <= SCALE_SPREAD for q, r in zip(ratios, points)):
        return True
    return all(0 < r.loss - r.ce <= ADDED_TERM * r.ce for r in points)


COMPARISON = "returned loss against the logits' cross-entropy (TFD233-TFD237)"
"""The check that stands aside when the returned loss is no cross-entropy of the logits (:func:`not_cross_entropy`)."""


NOT_CROSS_ENTROPY = (
    "the loss training_step returns is below the model's logits' cross-entropy, and no temperature, constant factor "
    "or share of supervised positions explains it: it is no cross-entropy of them (a contrastive loss, a regression "
    "head)"
)
"""Why :data:`COMPARISON` stands aside."""


def not_cross_entropy(points: Sequence[LossReading]) -> bool:
    """The returned loss is no cross-entropy of these logits at all (a contrastive loss, a regression head): at every
    point (at least two) it is below the logits' cross-entropy by :data:`AGREE` and three standard errors, and none of
    the families that lower it explains that: no single temperature (:data:`TEMPERATURE_MATCH`), no constant factor
    or supervised share (:data:`SCALE_SPREAD`); a bound, label smoothing or an added term only raise it."""
    if len(points) < 2 or not all(r.loss < (1.0 - AGREE) * r.ce - 3.0 * r.ce_error for r in points):
        return False
    ratios = [r.loss / r.ce for r in points]
    if min(ratios) > 0 and math.log(max(ratios) / min(ratios)) <= SCALE_SPREAD:
        return False  # loss / k (manual accumulation): a cross-entropy, scaled
    if all(q > 0 and abs(math.log(q / r.supervised_share)) <= SCALE_SPREAD for q, r in zip(ratios, points)):
        return False  # a sum over the supervised tokens divided by every label position
    return _shared_temperature(points) is None


def _series(values: Any) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _shared_temperature(points: Sequence[LossReading]) -> float | None:
    """The multiplier ``b`` that gives the returned loss at every point within :data:`TEMPERATURE_MATCH`, or None."""
    roots = [r.temperatures() for r in points]
    if not all(roots):
        return None
    for candidate in roots[0]:
        matched = [min(rs, key=lambda b: abs(math.log(b / candidate))) for rs in roots]
        if all(abs(math.log(b / candidate)) <= TEMPERATURE_MATCH for b in matched):
            return math.exp(sum(math.log(b) for b in matched) / len(matched))
    return None


RULES: tuple[Rule, ...] = (TFD233, TFD234, TFD235)
"""The rules decided in this module, in code order."""

BLOCK = ("TFD220", "TFD239")
"""The codes reserved for LossAtInit's rules (every one of its rule modules declares the same)."""
