"""UpdateRatio's decisions that need more than the ratio itself, without a Trainer: host floats only.

Tiny updates are a problem when they are too small to move the loss: a learning rate far too low shows as a loss that
barely falls. A fine-tune at a fine-tuning learning rate also has a small update-to-weight ratio (trained weights are
larger than initial ones, and the learning rate is lower on purpose), but its loss keeps falling: the updates are doing
their work. :func:`loss_still_falling` tells the two apart from the mean training loss of the measuring intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

LOSS_FALL_PER_STEP = 1e-3
"""The loss is still falling when its mean fell by at least this fraction of itself per optimizer step over the low
streak (0.1%: at that pace it falls by a tenth in 100 steps). Measured: full fine-tunes at lr 2e-4 fall by about
0.4% per step (TransformerEncoder LM), runs from scratch with the learning rate 100x too low by 0.02% to 0.03%
(TinyGPT at 1e-5, GPT-2 at 2e-5), so the line sits a factor of 3 or more from both."""


def loss_fall_per_step(losses: Sequence[tuple[int, float]]) -> float:
    """How fast the loss fell over ``losses`` (``(step, mean loss of the interval ending there)``, oldest first): the
    fall from the first to the last value, as a fraction of the first, per optimizer step. NaN when it cannot be told
    (fewer than two points, a non-finite or zero loss)."""
    if len(losses) < 2:
        return math.nan
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    if last_step <= first_step or not (math.isfinite(first) and math.isfinite(last)) or first == 0:
        return math.nan
    return (first - last) / abs(first) / (last_step - first_step)


def loss_still_falling(losses: Sequence[tuple[int, float]], min_fall_per_step: float = LOSS_FALL_PER_STEP) -> bool:
    """Whether the loss over ``losses`` fell by at least ``min_fall_per_step`` of itself per step; False when unknown
    (no loss to read: the ratio alone decides)."""
    rate = loss_fall_per_step(losses)
    return math.isfinite(rate) and rate >= min_fall_per_step


TRAINED_SPREAD = 0.005
"""The loss is a trained model's when it differs from batch to batch by at least this fraction of itself (0.5%). An
untrained classifier predicts near-uniformly whatever its input, so every batch costs about ln(C): measured 0.07% to
0.13% on TinyGPT and GPT-2 from scratch at a learning rate 100x too low. A trained model's loss depends on what each
batch holds: 1.3% to 3.5% per interval of 10 steps on the T5 fine-tune at lr 2e-4, 2% to 6% on TinyGPT from
scratch once it learns. The line sits a factor of 4 or more from the untrained runs and 2.5 from the lowest trained
interval (the median of the streak's intervals decides)."""


def trained(spreads: Sequence[float], min_spread: float = TRAINED_SPREAD) -> bool:
    """Whether the batch-to-batch spread of the loss (per measuring interval, a fraction of the loss; NaN unknown)
    says the model was trained before: its median over the intervals at least ``min_spread``.

    A small update-to-weight ratio means a learning rate too low for a model that still has everything to learn; for
    weights trained before (a fine-tune), a small ratio at a fine-tuning learning rate is the intent. The loss tells
    the two apart without knowing the model: an untrained model's predictions do not depend on its input, so its
    loss is the same on every batch. (A regression model's loss varies with its targets from the start: there this
    reads as trained.)
    """
    known = sorted(s for s in spreads if math.isfinite(s))
    return bool(known) and known[len(known) // 2] >= min_spread
