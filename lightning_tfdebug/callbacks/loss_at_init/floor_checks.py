"""LossAtInit's floors, without a Trainer: the lowest loss a run can reach when its logits are bounded (a soft-cap,
sigmoid or clamp in the model's forward or in ``training_step``) or its loss carries label smoothing, and whether that
floor binds (``TFD236``); label smoothing as a family of the returned loss, its ``eps`` fitted (``TFD237``).

The floors are closed forms over V classes: logits confined to a range of width ``w`` cannot give the right class
more than ``e^w / (e^w + V - 1)``, so no cross-entropy is below ``ln(1 + (V - 1) e^-w)`` (a cap ``c``: ``w = 2c``,
the floor ``-ln(e^c / (e^c + (V - 1) e^-c))``; a sigmoid: ``w = 1``); label smoothing ``eps`` trains against
``q = (1 - eps) onehot + eps / V``, whose entropy ``H(q)`` is the lowest cross-entropy against it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_tfdebug.callbacks.loss_at_init.readings import LossReading
from lightning_tfdebug.callbacks.loss_at_init.stall_checks import FLOOR_PINNED
from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.loss import uniform_loss
from lightning_tfdebug.functional.verdicts import Rule, Verdict


def width_floor(width: float, vocab: int) -> float:
    """The lowest cross-entropy over ``vocab`` classes of logits confined to a range of width ``width``:
    ``ln(1 + (V - 1) e^-w)``."""
    return math.log1p((vocab - 1) * math.exp(-width))


def cap_floor(cap: float, vocab: int) -> float:
    """The floor of a soft-cap ``c * tanh(logits / c)`` (or a clamp to ``[-c, c]``):
    ``-ln(e^c / (e^c + (V - 1) e^-c))``, the range ``2c``'s :func:`width_floor`."""
    return width_floor(2.0 * cap, vocab)


def smoothing_floor(eps: float, vocab: int) -> float:
    """The lowest cross-entropy against labels smoothed by ``eps`` (PyTorch's ``label_smoothing``: the target
    ``(1 - eps) onehot + eps / V``): that target's entropy, ``-a ln a - (V - 1) b ln b`` with ``a = 1 - eps + eps/V``,
    ``b = eps / V``."""
    if eps <= 0.0:
        return 0.0
    a, b = 1.0 - eps + eps / vocab, eps / vocab
    return -(a * math.log(a) if a > 0 else 0.0) - (vocab - 1) * b * math.log(b)


SMOOTHING_SPREAD = (0.01, 0.1)
"""Label smoothing: ``e = (loss - ce) / (uniform - ce)`` is the same at every step within ``max(0.01, 0.1 e)`` ..."""


SMOOTHING_MISS = 0.01
"""... and, for an ``eps`` above :data:`~.transform_checks.MAX_SMOOTHING` (where a bound can mimic a steady ``e``),
``(1 - eps) ce + eps uniform`` gives the loss at every step within this fraction (a cap of 0.75 that reads as a steady
``e`` of 0.45 to 0.49 misses by 1.6%; smoothing itself by 0 on the rows it reads)."""


SMOOTHING_FITS = (0.02, 0.03)
"""Label smoothing is named when ``eps`` is at least the first and gives the loss within the second fraction at every
step (a z-loss or a constant added term reads as a steady ``e`` of 0.001 to 0.01, or misses by 9%)."""


SMOOTHING_CLOSE = 0.005
"""... or ``(1 - eps) ce + eps uniform`` with the one fitted ``eps`` gives the loss at every step within this fraction
(an early step, whose logits are close to uniform, reads ``e`` from a small ``uniform - ce``: GPT-2 smoothed by 0.1
reads 0.117 at step 10, 0.100 after, and the fit misses by 0.26%)."""


def smoothing_fit(points: Sequence[LossReading]) -> tuple[float, float] | None:
    """``(eps, miss)``: the one label smoothing ``eps`` (least squares) for which ``(1 - eps) ce + eps uniform`` gives
    the returned loss at every point, and its largest relative miss; None when ``eps`` is not in ``(0, 1)`` or the
    per-point ``e`` is not steady (:data:`SMOOTHING_SPREAD`) and the fit not close (:data:`SMOOTHING_CLOSE`).
    :func:`named_smoothing` says whether it is named."""
    pairs = [(r.loss - r.ce, r.uniform - r.ce) for r in points if r.uniform > r.ce]
    if len(pairs) != len(points) or len(points) < 2:
        return None
    each = [gap / span for gap, span in pairs]
    eps = sum(gap * span for gap, span in pairs) / sum(span * span for _, span in pairs)
    if not (min(each) > 0.0 and max(each) < 1.0 and 0.0 < eps < 1.0):
        return None
    miss = max(abs((1.0 - eps) * r.ce + eps * r.uniform - r.loss) / r.loss for r in points)
    low, rel = SMOOTHING_SPREAD
    steady = max(each) - min(each) <= max(low, rel * sum(each) / len(each))
    return (eps, miss) if steady or miss <= SMOOTHING_CLOSE else None


def named_smoothing(fit: tuple[float, float]) -> bool:
    """The fit names label smoothing: ``eps`` and its miss within :data:`SMOOTHING_FITS`."""
    least, loosest = SMOOTHING_FITS
    return fit[0] >= least and fit[1] <= loosest


SMOOTHING_WARN = 0.5
"""TFD237 is a warning when the smoothing's floor is above this share of ln(V) (info naming ``eps`` otherwise)."""


TFD237 = Rule(
    "TFD237",
    "warning",
    "LossAtInit",
    title="the returned loss is label-smoothed with an eps whose floor is above half of ln(V)",
    headline="label smoothing eps = {eps:.3g}: the loss cannot fall below {floor:.2f} nats ({share_vocab:.0%} of ln V)",
    chart=EvidenceChart(
        "Does the returned loss follow the logits' own cross-entropy, above its floor?",
        "nats",
        evidence_x="steps",
        evidence_y=("returned_loss", "logits_loss"),
        lines=("floor", "expected_loss"),
    ),
    trigger=(
        "from the third compared step (step 30) the returned loss is the logits' cross-entropy with label smoothing "
        "eps: a warning when the smoothed target's entropy, its floor, is above half of ln(V); info naming eps "
        "otherwise"
    ),
    details=(
        "Per compared step `e = (L - C) / (U - C)` (`L` the returned loss, `C` the logits' cross-entropy, `U` their "
        "cross-entropy against a uniform target); `eps` the least-squares fit of `L = (1 - eps) C + eps U`. "
        "Steady: the `e` agree within `max(0.01, 0.1 e)`, or the fit gives `L` within 0.5% at every step. "
        "Named: `eps >= 0.02` and the fit within 3% (a z-loss or a constant added term reads as 0.001-0.01); for "
        "`eps > 0.3` within 1%, and then decided before a pinned bound (a soft-cap of 0.75 reads as a steady `e` of "
        "0.45-0.49 and misses by 1.6%). "
        "Floor: the entropy of `(1 - eps) onehot + eps / V`; a warning above 0.5 ln(V)."
    ),
    hint=(
        "Check the label_smoothing value (0.9 where 0.1 was meant keeps the model from ever becoming confident); "
        "usual values are 0.0 to 0.2."
    ),
    reason="Measured: the smoothing is fitted on the run's own loss, and its floor follows from eps and V alone",
    message=(
        "From step {first_step} to step {last_step} the loss training_step returned is the logits' cross-entropy "
        "with label smoothing eps = {eps:.3g} (largest miss {miss:.2%} of the loss). Its floor, the entropy of the "
        "smoothed target, is {floor:.3f} nats: {share_vocab:.0%} of ln(V) = {expected:.3f} (V={vocab}) and "
        "{share_loss:.0%} of the loss now ({loss:.3f}){tail}."
    ),
)


def smoothing_verdict(points: Sequence[LossReading], fit: tuple[float, float], vocab: int) -> Verdict:
    """``TFD237`` for the smoothing :func:`smoothing_fit` found: a warning when its floor is above
    :data:`SMOOTHING_WARN` of ln(V), info naming ``eps`` otherwise. Its evidence carries the floor for
    :func:`floor_verdict`."""
    eps, miss = fit
    floor, expected, last = smoothing_floor(eps, vocab), uniform_loss(vocab), points[-1]
    warn = floor > SMOOTHING_WARN * expected
    tail = ": the model can never become confident" if warn else ""
    evidence = _floor_evidence(points, floor, vocab, eps=eps, miss=miss, source="label smoothing")
    return TFD237.verdict(
        evidence,
        severity="warning" if warn else "info",
        step=last.step,
        first_step=points[0].step,
        last_step=last.step,
        share_vocab=floor / expected,
        expected=expected,
        vocab=vocab,
        share_loss=floor / last.loss,
        loss=last.loss,
        tail=tail,
    )


def _floor_evidence(points: Sequence[LossReading], floor: float, vocab: int, **extra: Any) -> dict[str, Any]:
    expected, last = uniform_loss(vocab), points[-1]
    return {
        "steps": [r.step for r in points],
        "returned_loss": [r.loss for r in points],
        "logits_loss": [r.ce for r in points],
        "logit_range": [r.logit_range for r in points],
        "floor": floor,
        "floor_share_of_ln_vocab": floor / expected,
        "floor_share_of_loss": floor / last.loss,
        "expected_loss": expected,
        **extra,
    }


FLOOR_BINDS = 0.5
"""TFD236: a floor at or above this share of ln(V) binds (no model of these logits becomes confident: a perplexity of
at least V^0.5; the held-out bugs' floors: 0.64 to 0.96; label smoothing 0.1 over 259 classes: 0.16)."""


RANGE_ALIKE = 0.05
"""A bound in the model's forward: on the last two compared steps the rows' logit ranges spread by at most this
fraction of their mean (a saturated tanh: 0.01; healthy rows 0.1 and more) ..."""


RANGE_STILL = 0.05
"""... their mean grew by at most this fraction between those steps (a healthy model's keeps growing) ..."""


LEFT_UNIFORM = 0.05
"""... the logits' cross-entropy has left ln(V) by this fraction of it (an untrained model's range is small), and lies
within :data:`~.stall_checks.FLOOR_PINNED` of the way from the floor of the rows' ranges up to ln(V) (the bounded
models measured: 0.23 to 0.26 at steps 30-40; a slow healthy model whose range barely grows: 0.7 and more)."""


TFD236 = Rule(
    "TFD236",
    "error",
    "LossAtInit",
    title="the loss cannot fall below a floor set by bounded logits or label smoothing, above half of ln(V)",
    headline=(
        "the loss trains squashed logits (cap c = {cap:.3g}, floor {floor:.2f} nats)",
        "the loss cannot fall below a floor of {floor:.2f} nats ({share_vocab:.0%} of ln V)",
    ),
    chart=EvidenceChart(
        "Does the returned loss follow the logits' own cross-entropy, above its floor?",
        "nats",
        evidence_x="steps",
        evidence_y=("returned_loss", "logits_loss"),
        lines=("floor", "expected_loss"),
    ),
    trigger=(
        "from the third compared step (step 30) the logits are bounded, in the model's forward or in training_step, or "
        "the loss is label-smoothed, and the lowest loss that allows is at least half of ln(V)"
    ),
    details=(
        "A bound in training_step: the returned loss fitted as `c * tanh(logits / c)` (floor `ln(1 + (V-1) e^-2c)`) "
        "or `sigmoid(logits)` (width 1) within 3% and closer than any temperature, or pinned at a bound's floor "
        "(`TFD233`'s width). "
        "A bound in the forward: on the last two compared steps every row's logit range alike (spread at most 5% of "
        "the mean), the mean grown by at most 5%, the logits' cross-entropy 5% below ln(V) and within 30% of the way "
        "from the floor of that range up to ln(V) (the floor: the mean of `ln(1 + (V-1) e^-w)` over the rows); not "
        "when step 0 found probabilities (`TFD220`). "
        "Label smoothing: `TFD237`'s `eps`, the floor the smoothed target's entropy. "
        "Binds: the floor at least 0.5 ln(V). The message gives it as a share of ln(V) and of the loss now."
    ),
    hint=(
        "Raise or remove the bound: a final-logit soft-cap of 1 where 30 was meant, a sigmoid, tanh or clamp on the "
        "logits, or label smoothing far above 0.1. The cross-entropy needs raw logits whose range can grow."
    ),
    reason="A rule that always holds: no model brings this loss below the floor, at most V^-0.5 from a uniform guess",
    message=(
        "The lowest loss this run can reach is {floor:.3f} nats: {share_vocab:.0%} of ln(V) = {expected:.3f} "
        "(V={vocab}) and {share_loss:.0%} of its loss at step {at_step} ({loss:.3f}). {why} No training can bring "
        "the loss below it: the model can never put more than {top:.1%} of the probability on the right token."
    ),
)


def floor_verdict(
    points: Sequence[LossReading], vocab: int, transform: Verdict | None, *, probabilities: bool = False
) -> Verdict | None:
    """``TFD236``: the floor the compared steps show, when it is at least :data:`FLOOR_BINDS` of ln(V). Its source,
    first found wins: the returned loss's family (``transform``: ``TFD233``'s cap, sigmoid or pinned width, or
    ``TFD237``'s smoothing, whose evidence carries the floor), else logits bounded in the model's forward
    (:func:`model_bound`; not when step 0 found probabilities, ``TFD220``'s)."""
    if len(points) < 2:
        return None
    evidence = dict(transform.evidence) if transform is not None else {}
    floor = evidence.get("floor")
    if transform is not None and floor is not None and transform.code == TFD237.code:
        why = (
            f"The loss is label-smoothed with eps = {evidence['eps']:.3g}; the smoothed target's entropy is its floor."
        )
        top = 1.0 - evidence["eps"] + evidence["eps"] / vocab
    elif transform is not None and floor is not None:
        width = evidence.get("width", float("nan"))
        what = f"a soft-cap c = {evidence['cap']:.3g}" if "cap" in evidence else evidence.get("bound", "a bound")
        why = (
            f"training_step bounds the logits before the loss ({what}: a range of width {width:.3g}), "
            f"and ln(1 + (V-1) e^-w) is the floor of that width."
        )
        top = 1.0 / (1.0 + (vocab - 1) * math.exp(-width))
    else:
        width = None if probabilities else model_bound(points, uniform_loss(vocab))
        if width is None:
            return None
        floor = width_floor(width, vocab)
        why = (
            f"The logits the model returns are bounded: every row spans the same range, {width:.3g} (spread "
            f"{points[-1].range_spread:.1%}), which stopped growing ({points[-2].logit_range:.3g} at step "
            f"{points[-2].step}): a soft-cap, tanh, sigmoid or clamp inside the forward, and ln(1 + (V-1) e^-w) is the "
            "floor of that range (of the bound's own width, once the rows reach it)."
        )
        top = 1.0 / (1.0 + (vocab - 1) * math.exp(-width))
        evidence = _floor_evidence(points, floor, vocab, width=width, source="the model's forward")
    expected, last = uniform_loss(vocab), points[-1]
    if not (math.isfinite(floor) and floor >= FLOOR_BINDS * expected):
        return None
    evidence.update(floor=floor, floor_share_of_ln_vocab=floor / expected, floor_share_of_loss=floor / last.loss)
    return TFD236.verdict(
        evidence,
        step=last.step,
        share_vocab=floor / expected,
        expected=expected,
        vocab=vocab,
        share_loss=floor / last.loss,
        loss=last.loss,
        at_step=last.step,
        why=why,
        top=top,
    )


def model_bound(points: Sequence[LossReading], expected: float) -> float | None:
    """The width of the range the model's own logits are held in, or None: on the last two compared steps every
    row's range is alike (:data:`RANGE_ALIKE`), it grew by at most :data:`RANGE_STILL`, and the logits' cross-entropy
    is :data:`LEFT_UNIFORM` below ``expected``, ln(V) (training moved them: a small range at init is no bound), on
    that range's floor."""
    prev, last = points[-2], points[-1]
    if not all(math.isfinite(r.range_spread) and r.range_spread <= RANGE_ALIKE for r in (prev, last)):
        return None
    if not (0 < last.logit_range <= (1.0 + RANGE_STILL) * prev.logit_range):
        return None
    if not last.ce <= (1.0 - LEFT_UNIFORM) * expected:
        return None
    if last.ce - last.floor > FLOOR_PINNED * (expected - last.floor):
        return None  # the loss is not on that range's floor (a slow model whose range barely grows)
    return last.logit_range


RULES: tuple[Rule, ...] = (TFD237, TFD236)
"""The rules decided in this module, in code order."""

BLOCK = ("TFD220", "TFD239")
"""The codes reserved for LossAtInit's rules (every one of its rule modules declares the same)."""
