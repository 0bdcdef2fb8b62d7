"""LossAtInit's findings at the check, in one order (the stall, copy, bound, context and transform decisions of
:mod:`.stall_checks` and :mod:`.transform_checks`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from lightning_tfdebug.callbacks.loss_at_init.floor_checks import floor_verdict
from lightning_tfdebug.callbacks.loss_at_init.phases import COMPARE_FRACTIONS, EARLY_DECISION, LossRun
from lightning_tfdebug.callbacks.loss_at_init.readings import CheckReading
from lightning_tfdebug.callbacks.loss_at_init.stall_checks import (
    TFD231,
    TFD232,
    bounded_output_verdict,
    check_verdicts,
    context_verdict,
    flat_window,
)
from lightning_tfdebug.callbacks.loss_at_init.transform_checks import TFD233, loss_transform_verdict, not_cross_entropy
from lightning_tfdebug.functional.verdicts import Verdict


def check_findings(
    reading: CheckReading,
    step: int,
    run: LossRun,
    *,
    unigram_entropy: float | None,
    vocab: int,
    stall_tolerance: float,
    copy_threshold: float,
    learning_rates: Sequence[float] = (),
    shift_labels: bool = True,
) -> list[Verdict]:
    """Every finding of the check at ``step``: a stall or a copying model (:func:`check_verdicts`), bounded outputs
    (:func:`bounded_output_verdict`, unless step 0 found probabilities: ``TFD220``'s), the loss at the unigram entropy
    (:func:`context_verdict`) and the returned loss against the logits and its floor (:func:`comparison_verdicts`, the
    codes the compared steps said before left out). ``TFD233`` drops ``TFD231`` and ``TFD232``: the loss does not train
    these logits."""
    window = run.window(step)
    unigram = unigram_entropy if unigram_entropy is not None else math.nan
    verdicts: list[Verdict | None] = list(
        check_verdicts(
            reading.loss,
            reading.expected,
            step,
            window=window,
            unigram_entropy=unigram,
            stall_tolerance=stall_tolerance,
            copy_rate=reading.copy_rate,
            repeat_rate=reading.repeat_rate,
            init_copy_rate=run.init_copy_rate,
            copy_threshold=copy_threshold,
            learning_rates=learning_rates,
            shift_labels=shift_labels,
        )
    )
    if not run.probabilities:
        verdicts.append(
            bounded_output_verdict(
                reading.recomputed,
                reading.floor,
                reading.logit_range,
                reading.expected,
                unigram,
                step,
                stall_tolerance=stall_tolerance,
                range_spread=reading.range_spread,
            )
        )
    verdicts.append(
        context_verdict(
            reading.own_loss,
            reading.rolled_loss,
            unigram,
            step,
            own_match=reading.own_match,
            rolled_match=reading.rolled_match,
            flat=flat_window(window, reading.loss, reading.expected, stall_tolerance),
            window_steps=step - min((s for s, _ in window), default=step),
            masked=run.masked_lm,
            per_sequence=reading.per_sequence,
        )
    )
    transform, floor = comparison_verdicts(run, vocab, unigram, last=CHECK_READINGS)
    # The order between the check's codes, in this one place: TFD230 stands aside for TFD220 (probabilities are a
    # bounded output whose cause step 0 already named), and TFD233 overrides TFD231/TFD232 (a bound on the returned
    # loss holds it near the unigram entropy whatever the logits learn, so "labels from other samples" or "the model
    # ignores its context" would blame the wrong thing). TFD225 and TFD226 never conflict: they are kept together.
    if transform is not None and transform.code == TFD233.code:
        verdicts = [v for v in verdicts if v is None or v.code not in (TFD231.code, TFD232.code)]
    verdicts = [*verdicts, *(v for v in (transform, floor) if v is not None and run.unsaid([v.code]))]
    return [dataclasses.replace(v, step=step) for v in verdicts if v is not None]


CHECK_READINGS = len(COMPARE_FRACTIONS) + 1
"""The check decides on its own window: the compared steps at the fractions of the way to it and itself (the early
steps decided theirs; a loss that drifts away from the logits as they grow is judged where it drifted)."""


def comparison_verdicts(
    run: LossRun, vocab: int, unigram_entropy: float, last: int | None = None
) -> tuple[Verdict | None, Verdict | None]:
    """The family of the returned loss against the recorded logits (:func:`loss_transform_verdict`: ``TFD233`` to
    ``TFD235``, ``TFD237``) and the floor it or the logits' own range sets (:func:`floor_verdict`, ``TFD236``), from
    the compared steps so far (the ``last`` of them); none once the comparison stood aside (the loss is no
    cross-entropy of the logits)."""
    if run.compare_aside:
        return None, None
    points = run.readings[-last:] if last else run.readings
    transform = loss_transform_verdict(points, vocab, unigram_entropy)
    return transform, floor_verdict(points, vocab, transform, probabilities=run.probabilities)


def comparison_aside(run: LossRun) -> bool:
    """True once, when the compared steps show a returned loss that is no cross-entropy of the logits
    (:func:`not_cross_entropy`): the comparison stands aside from then on (``run.compare_aside``)."""
    if run.compare_aside or not not_cross_entropy(run.readings):
        return False
    run.compare_aside = True
    return True


EARLY_MOVED = 0.01
"""An early comparison decides only once the logits' own cross-entropy has moved by this share of ln V across the
compared steps: on logits that barely train (a learning rate far too low, a warm-up longer than the run) a constant
gap between the returned loss and the logits fits every transform alike."""


EARLY_AGREE = 2e-3
"""The returned loss equals the logits' cross-entropy under the configured alignment within this share at every
compared step: nothing between the logits and the loss, whichever alignment the logits happen to fit better early on
(repetitive text)."""


def early_findings(run: LossRun, vocab: int, unigram_entropy: float | None) -> list[Verdict]:
    """The comparison's findings on a compared step before the check, from the :data:`EARLY_DECISION`-th on: those
    of :func:`comparison_verdicts` not said before (each code once per run; ``unigram_entropy`` None: not known)."""
    if len(run.readings) < EARLY_DECISION:
        return []
    ces = [r.ce for r in run.readings if math.isfinite(r.ce)]
    if not ces or max(ces) - min(ces) < EARLY_MOVED * math.log(max(vocab, 2)):
        return []  # the logits have not moved yet: no transform or smoothing can be told apart (the check decides)
    unigram = unigram_entropy if unigram_entropy is not None else math.nan
    transform, floor = comparison_verdicts(run, vocab, unigram)
    if all(abs(r.loss - r.configured_ce) <= EARLY_AGREE * r.loss for r in run.readings) and not run.compare_aside:
        # the returned loss is the logits' own cross-entropy as configured: nothing between them (the other alignment
        # may fit repetitive text better early on); only a bound inside the forward, read from the logits' range
        transform, floor = None, floor_verdict(run.readings, vocab, None, probabilities=run.probabilities)
    return [v for v in (transform, floor) if v is not None and run.unsaid([v.code])]


COVERED_ROW = "loss = cross-entropy of the logits"
"""The Coverage row the comparison of the returned loss with the logits' own cross-entropy answers."""

COVERAGE: dict[str, tuple[str, ...]] = {
    "loss at init": (
        "TFD220",
        "TFD221",
        "TFD222",
        "TFD223",
        "TFD224",
        "TFD227",
    ),
    "loss = cross-entropy of the logits": (
        "TFD229",
        "TFD233",
        "TFD234",
        "TFD235",
        "TFD236",
        "TFD237",
    ),
    "loss leaves the uniform level": (
        "TFD225",
        "TFD226",
        "TFD230",
        "TFD231",
        "TFD232",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
