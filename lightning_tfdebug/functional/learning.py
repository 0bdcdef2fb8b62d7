"""One reading of "has this model learned?", shared by every callback that needs it, without a Trainer.

A model's *progress* is where its loss sits from ``ln(V)`` (0: knows nothing) to the labels' unigram entropy ``H``
(1: knows the class frequencies). :func:`trained_before`: the first measured loss made :data:`TRAINED_PROGRESS` of
the way (weights trained before this run); :func:`learned`: that, or the latest loss is :data:`BEYOND_FREQUENCIES`
past ``H``. The calibration across model families is in ``docs/severity.md``.
"""

from __future__ import annotations

import math

TRAINED_PROGRESS = 0.35
"""The first measured loss of weights trained before this run has made at least this much of the way from ln(V) to
the unigram entropy (fine-tunes 0.67 and more, untrained models 0.006 and less)."""
BEYOND_FREQUENCIES = 0.1
"""A model learned in this run when its latest loss is below the unigram entropy by this fraction of the way from
ln(V) (progress 1.1)."""
ASSUMED_UNIGRAM_FRACTION = 0.5
"""The unigram entropy assumed, as a fraction of ln(V), when the labels could not be counted."""
MIN_SPAN = 0.05
"""The way from ln(V) to the unigram entropy counts as at least this fraction of ln(V) (labels near uniform: the
frequencies teach nothing, and any fall below ln(V) is learning)."""


def progress(loss: float, ln_vocab: float, unigram_entropy: float = math.nan) -> float:
    """Where ``loss`` sits from ``ln_vocab`` (0) to the labels' ``unigram_entropy`` (1); NaN when the loss or ln(V) is
    not known. An unknown unigram entropy is taken as :data:`ASSUMED_UNIGRAM_FRACTION` of ln(V)."""
    if not (math.isfinite(loss) and math.isfinite(ln_vocab) and ln_vocab > 0):
        return math.nan
    unigram = unigram_entropy if math.isfinite(unigram_entropy) else ASSUMED_UNIGRAM_FRACTION * ln_vocab
    span = max(ln_vocab - unigram, MIN_SPAN * ln_vocab)
    return (ln_vocab - loss) / span


def trained_before(first_loss: float, ln_vocab: float, unigram_entropy: float = math.nan) -> bool | None:
    """Whether the weights were trained before this run: the first measured loss made :data:`TRAINED_PROGRESS` of the
    way from ln(V) to the unigram entropy. None when it cannot be told (no loss, no vocabulary size)."""
    value = progress(first_loss, ln_vocab, unigram_entropy)
    return None if math.isnan(value) else value >= TRAINED_PROGRESS


def learned(first_loss: float, latest_loss: float, ln_vocab: float, unigram_entropy: float = math.nan) -> bool | None:
    """Whether the model has learned: it was trained before this run (:func:`trained_before`), or its latest loss is
    below the unigram entropy by :data:`BEYOND_FREQUENCIES` of the way (it learned in this run, beyond the
    frequencies). None when neither loss can be read against ln(V)."""
    before = trained_before(first_loss, ln_vocab, unigram_entropy)
    now = progress(latest_loss, ln_vocab, unigram_entropy)
    if before is None and math.isnan(now):
        return None
    return bool(before) or (not math.isnan(now) and now >= 1.0 + BEYOND_FREQUENCIES)
