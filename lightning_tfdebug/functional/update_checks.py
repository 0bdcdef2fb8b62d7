"""UpdateRatio's decisions that need more than the ratio itself, without a Trainer: host floats, and the label count
it reads the unigram entropy from (see :mod:`lightning_tfdebug.functional.learning` for whether the model learned).

Tiny updates are a problem when they are too small to move the loss: a learning rate far too low shows as a loss that
barely falls. A fine-tune at a fine-tuning learning rate also has a small update-to-weight ratio (trained weights are
larger than initial ones, and the learning rate is lower on purpose), but its loss keeps falling: the updates are doing
their work. :func:`loss_still_falling` tells the two apart from the mean training loss of the measuring intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_tfdebug.functional.loss import label_counts as count_labels

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


def label_counts(labels: Tensor | None, vocab_size: int, ignore_index: int, device: torch.device) -> Tensor:
    """How often each class ``0 .. vocab_size - 1`` occurs among the supervised labels, on ``device``: LossAtInit's
    count (:func:`lightning_tfdebug.functional.loss.label_counts`, no host sync), and zeros when the batch holds no
    integer labels, so every rank packs a vector of the same length."""
    if labels is None or labels.is_floating_point() or labels.dtype == torch.bool:
        return torch.zeros(vocab_size, device=device)
    return count_labels(labels.to(device), vocab_size, ignore_index)


def outside_optimizers(params: Sequence[Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> list[bool] | None:
    """For each of ``params``, whether it is in none of the ``optimizers``' param groups (compared by identity). None
    when that cannot be told: no parameter of ``params`` is held by any optimizer (a strategy whose optimizer holds
    copies or flattened views of the model's parameters), which says more about the wrapping than about the model."""
    held = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    outside = [id(p) not in held for p in params]
    return None if all(outside) else outside


def expected_step(lr: float, adaptive: bool, grad_rms: float) -> float:
    """The typical change of one element in one optimizer step: about ``lr`` for the Adam family (the step is
    ``lr * m / (sqrt(v) + eps)``, of order one times the LR), ``lr * rms(grad)`` for SGD-like optimizers."""
    return lr if adaptive else lr * grad_rms


def below_resolution(step: float, weight_rms: float, eps: float) -> bool:
    """Whether a change of ``step`` to weights of size ``weight_rms`` rounds back to the same weights: below half the
    spacing of their dtype's floats there (``eps * |w| / 2``; ``eps`` is ``torch.finfo(dtype).eps``: 1.2e-7 for fp32,
    7.8e-3 for bf16). Adam at lr 1e-8 cannot move fp32 norm gains of 1.0 (half a ulp is 6e-8); it moves matrices of
    rms 0.02 (half a ulp 1.2e-9)."""
    return weight_rms > 0 and step < eps * weight_rms / 2
