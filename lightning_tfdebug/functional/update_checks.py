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
from lightning_tfdebug.functional.verdicts import Rule

TFD310 = Rule(
    "TFD310",
    "warning",
    "UpdateRatio",
    title="updates too small for the LR plateau, and the loss barely moves: LR too low",
    trigger=(
        "update:weight ratio below `low` for `patience` measurements while the LR is at its plateau (not in "
        "warm-up, not decayed below `decayed_lr_fraction` of its peak), and over them the mean training loss "
        "fell by less than 0.1% of itself per step, and the model has not learned: its first measured loss made "
        "less than 0.35 of the way from ln(V) to the labels' unigram entropy (a fine-tune starts most of the way "
        "down) and its latest loss is not below that entropy (`lightning_tfdebug.functional.learning`)"
    ),
    hint=(
        "The learning rate is probably too low (with AdamW, ratio ~ lr / rms(W)). Raise it, or run an LR range "
        "test; check that the scheduler is not stuck at its initial factor. Groups named in "
        "`groups_below_resolution` did not change at all: the optimizer stepped them by less than half the float "
        "spacing of their weights (AdamW at lr 1e-8 on fp32 norm gains of 1.0), and they rounded back."
    ),
    reason="Measured: updates too small to move the weights, and the loss shows the model has not learned",
)

TFD311 = Rule(
    "TFD311",
    "warning",
    "UpdateRatio",
    title="one step rewrote a large part of the weights: LR too high / no warm-up",
    trigger="update:weight ratio above `high` on any measurement",
    hint=(
        "The learning rate is probably too high, or there is no warm-up: each step rewrites a large part of the "
        "weights. Lower the LR or add warm-up; GradNormMonitor shows whether gradients explode too."
    ),
    reason="Measured: one optimizer step rewrote a large part of the weights",
)

TFD312 = Rule(
    "TFD312",
    "error",
    "UpdateRatio",
    title="a group got gradients but did not change: not in the optimizer",
    trigger=(
        "a group received gradients but did not change when the optimizer stepped, `patience` measurements in a "
        "row, and holds parameters in none of the optimizers' param groups (when the optimizer holds copies and "
        "that cannot be told: its expected step is not below half the float spacing of its weights). A group in "
        "the optimizer whose step rounds away is TFD310's evidence instead"
    ),
    hint=(
        "Their parameters are not in the optimizer (built before the module was added, or filtered out in "
        "configure_optimizers). Add them, or set requires_grad=False if they should stay fixed."
    ),
    reason=(
        "A group that receives gradients but never changes is not being trained: the model cannot learn as configured"
    ),
)

TFD313 = Rule(
    "TFD313",
    "warning",
    "UpdateRatio",
    title=("the weights inflate (median group norm grew > `growth_limit` x in `growth_window` steps): LR far too high"),
    trigger=(
        "the median group weight norm grew more than `growth_limit` x within `growth_window` optimizer steps "
        "(groups under 5% of the largest group's norm left out)"
    ),
    hint=(
        "Each step moves the weights a lot against their own scale (Adam moves every weight by about the LR per "
        "step), so they inflate instead of learning; the loss typically stalls on a plateau or spikes. The "
        "learning rate is probably far too high: transformers trained with AdamW usually peak between 1e-4 and "
        "1e-3 (a few times more for tiny models). Lower it, and keep a warm-up."
    ),
    reason="Measured: the weights inflate within a short window, which a learning rate far too high does",
)

TFD314 = Rule(
    "TFD314",
    "warning",
    "UpdateRatio",
    title=(
        "the weights deflate (median group norm fell below 1/`growth_limit` in `growth_window` steps): decay far "
        "too strong"
    ),
    trigger=(
        "the median group weight norm fell below `1 / growth_limit` of its value within `growth_window` optimizer steps"
    ),
    hint=(
        "Weight decay is far too strong for this learning rate (AdamW decays by lr x weight_decay every step: "
        "typical products are 1e-5 to 1e-4, e.g. lr 3e-4 with weight_decay 0.1), so decay, not the loss, sets the"
        " weights' scale. Lower weight_decay; check it is not an L2 coefficient meant for SGD scaled up, or "
        "applied twice (by the optimizer and a penalty in the loss)."
    ),
    reason="Measured: the weights deflate within a short window, which weight decay far too strong does",
)

BLOCK = ("TFD310", "TFD319")
"""The codes reserved for UpdateRatio's rules."""

RULES: tuple[Rule, ...] = (
    TFD310,
    TFD311,
    TFD312,
    TFD313,
    TFD314,
)
"""The rules decided in this module, in code order."""


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
