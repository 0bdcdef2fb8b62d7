"""OptimizerAudit's measured decisions, without a Trainer: host floats only.

Weight decay on one-dimensional parameters (norm gains, biases) is a lint (``TFD324``, info): published recipes build
``AdamW(model.parameters(), weight_decay=...)`` over every parameter, and at their decay values and run lengths
nothing measurable happens to those parameters. It is a warning once the run shows the harm: the decayed 1-D
parameters' norm falls against its own first measured value, by more than :data:`SHRINK` of it, and the decay itself
accounts for at least :data:`DECAY_SHARE` of that fall (gradients also move norm gains, up or down; a fall the decay
could not have caused is the loss's doing).
"""

from __future__ import annotations

import math
from typing import Any

from lightning_tfdebug.functional.verdicts import Rule, Verdict

TFD320 = Rule(
    "TFD320",
    "error",
    "OptimizerAudit",
    title="trainable parameters in no param group (named)",
    trigger="trainable parameters in no param group (names them)",
    hint=(
        "Build the optimizer from all trainable parameters (after the model is complete and moved), or freeze "
        "these with requires_grad=False if that is the intent."
    ),
    reason="Parameters in no param group never change: part of the model cannot be trained as configured",
)

TFD321 = Rule(
    "TFD321",
    "error",
    "OptimizerAudit",
    title="parameters in more than one param group or optimizer",
    trigger="a parameter in more than one param group / optimizer",
    hint="Each parameter must be stepped by exactly one param group; build the groups from disjoint sets.",
    reason=(
        "A parameter stepped by two groups or optimizers gets two updates per step (or the optimizer refuses it): "
        "the run is not the one configured"
    ),
)

TFD322 = Rule(
    "TFD322",
    "info",
    "OptimizerAudit",
    title="frozen parameters still in the optimizer (a warning once one of them moves)",
    trigger=(
        "frozen parameters (`requires_grad=False`) still in the optimizer: info, since torch optimizers skip "
        "parameters without a gradient; a warning when a measured step changes one of them"
    ),
    hint=(
        "Harmless with torch optimizers, which skip parameters whose .grad is None. An optimizer that steps them "
        "anyway (weight decay or momentum applied without a gradient, a custom optimizer, a .grad set by hand) "
        "moves frozen weights: build the optimizer from `[p for p in model.parameters() if p.requires_grad]`."
    ),
    reason=(
        "Torch optimizers skip parameters without a gradient, so frozen ones stay put; a warning once one is "
        "measured to move"
    ),
)

TFD323 = Rule(
    "TFD323",
    "error",
    "OptimizerAudit",
    title="the optimizer holds tensors that are not parameters of the module",
    trigger="the optimizer holds tensors that are not parameters of the module (stale copies)",
    hint=(
        "The optimizer was built before the model was moved, copied or rebuilt; build it in "
        "`configure_optimizers` from `self.parameters()`."
    ),
    reason=(
        "The optimizer updates tensors the model does not use, so the model's own weights are not the ones being "
        "trained"
    ),
)

TFD324 = Rule(
    "TFD324",
    "info",
    "OptimizerAudit",
    title="weight decay on 1-D parameters (norm weights, biases); a warning once they are measured to shrink",
    trigger=(
        "weight decay > 0 on 1-D parameters (norm weights, biases); a warning when their norm, measured on "
        "measuring steps, fell by more than 10% of its first measured value and the decay alone "
        "(`1 - exp(-sum lr * weight_decay)`) accounts for at least half of that fall"
    ),
    hint=(
        "Put biases and norm weights in a param group with weight_decay=0.0 (decay only parameters with ndim >= "
        "2); shrinking norm gains toward zero hurts training."
    ),
    reason=(
        "A lint: at common decay values and run lengths nothing measurable happens to norm gains and biases; a "
        "warning when their norm is measured to shrink"
    ),
)

TFD325 = Rule(
    "TFD325",
    "info",
    "OptimizerAudit",
    title="weight decay on embedding tables",
    trigger="weight decay > 0 on embedding tables",
    hint="Many transformer recipes exclude embeddings from weight decay; check it is intended.",
    reason="A lint: common practice excludes embeddings from decay, but no harm is measured",
)

TFD326 = Rule(
    "TFD326",
    "info",
    "OptimizerAudit",
    title="Adam-family optimizer with `weight_decay > 0` (coupled L2): use AdamW",
    trigger="`Adam`-family optimizer with `weight_decay > 0` (coupled L2)",
    hint="Use torch.optim.AdamW (decoupled weight decay), with a no-decay group for biases and norms.",
    reason=(
        "A lint: coupled L2 is rescaled by Adam's step, so the decay is weaker and uneven, but no harm is measured "
        "in the run"
    ),
)

TFD327 = Rule(
    "TFD327",
    "error",
    "OptimizerAudit",
    title="the module is in eval mode at a training batch",
    trigger="the module is in eval mode at the first batch of an epoch or after validation",
    hint=(
        "Something calls `.eval()` (a hook, an inference helper, a generation callback) without calling "
        "`.train()` after; Lightning sets train mode before each epoch, so look at hooks that run later."
    ),
    reason=(
        "Training in eval mode turns dropout off and freezes normalisation statistics: the run is not the training "
        "configured"
    ),
)

TFD328 = Rule(
    "TFD328",
    "info",
    "OptimizerAudit",
    title="mode-dependent submodules in eval mode while the module trains",
    trigger="dropout / norm submodules in eval mode while the module trains",
    hint="Deliberate for frozen BatchNorm; otherwise a submodule was left in eval mode.",
    reason="An observation: deliberate for frozen normalisation layers, and no harm is measured",
)

TFD329 = Rule(
    "TFD329",
    "warning",
    "OptimizerAudit",
    title="the LR scheduler stepped more than once per optimizer step",
    trigger="an LR scheduler stepped more than once between two steps of its optimizer",
    hint=(
        "Step the scheduler once per optimizer step (not per micro-batch under gradient accumulation), and not by"
        " hand when Lightning already steps it (`interval: step` in configure_optimizers)."
    ),
    reason=(
        "Measured: the schedule runs several times faster than the optimizer steps, so the learning rate applied is"
        " not the one planned"
    ),
)

TFD330 = Rule(
    "TFD330",
    "info",
    "OptimizerAudit",
    title="no learning-rate warm-up on a transformer (a warning once the early loss spikes)",
    trigger=(
        "a transformer trained from step 0 has an LR at a later measured step that is not above its first-step LR;"
        " a warning when a measured loss in the first `warmup_window` steps is not finite, rises above the first "
        "step's loss or doubles from its lowest point (what a warm-up prevents). Never decided from the first "
        "step after a resume"
    ),
    hint=(
        "Many runs train well without warm-up (fine-tuning, small models, constant LR). If the early loss spikes "
        "or diverges, add a linear warm-up (a few hundred to a few thousand steps) before the peak LR: Adam's "
        "early updates on attention and embeddings are large without it."
    ),
    reason="A lint: many runs train well without a warm-up; a warning once the early loss is measured to spike",
)

TFD331 = Rule(
    "TFD331",
    "warning",
    "OptimizerAudit",
    title="the LR reached zero long before the end of the run",
    trigger="the LR reached zero before `zero_lr_fraction` of the run",
    hint=(
        "Size the schedule (total / decay steps) in optimizer steps of this run, accounting for gradient "
        "accumulation and the number of devices."
    ),
    reason="Loses work: the steps after the learning rate reached zero train nothing",
)

TFD332 = Rule(
    "TFD332",
    "warning",
    "OptimizerAudit",
    title="a parameter byte-identical after steps that should have changed it",
    trigger="a parameter with a gradient and LR > 0 byte-identical after `patience` measured steps",
    hint=(
        "The update underflows the parameter's dtype (bf16/fp16 weights with a small LR: keep fp32 master "
        "weights), or the optimizer steps other tensors than the model uses."
    ),
    reason="Measured: a parameter with a gradient and a learning rate did not change over several steps",
)

TFD333 = Rule(
    "TFD333",
    "warning",
    "OptimizerAudit",
    title=(
        "Adam-family optimizer over float16 parameters with `eps` < 1.7e-5: float16 moments underflow, huge or "
        "infinite steps"
    ),
    trigger=(
        "an Adam-family optimizer steps float16 parameters (so float16 moments) with `eps` < 1.7e-5: the second "
        "moment of gradients below 1.7e-4 underflows to 0 and the step is `lr * m / eps`, over 10x Adam's normal "
        "step (division by zero when `eps` rounds to 0, as 1e-8 does)"
    ),
    hint=(
        "Keep fp32 master weights and optimizer state (precision='16-mixed' or 'bf16-mixed' instead of "
        "'16-true'), or raise eps to 1e-4 or more for float16 optimizer math."
    ),
    reason=(
        "Any gradient below 1.7e-4, which every run has, makes its step lr * m / eps: huge or infinite steps at "
        "this configuration"
    ),
)

TFD334 = Rule(
    "TFD334",
    "error",
    "OptimizerAudit",
    title="gradients not zeroed between optimizer steps (manual optimization without `zero_grad`)",
    trigger=(
        "at the first backward after an optimizer step (on a measuring step), a param group's probe parameter "
        "still holds non-zero gradients from earlier steps"
    ),
    hint=(
        "With manual optimization call `optimizer.zero_grad()` once per optimizer step (before the backward of "
        "the next accumulation window, or right after `optimizer.step()`)."
    ),
    reason=("Gradients never zeroed add every step's gradient to all earlier ones: the run cannot train as configured"),
)

TFD335 = Rule(
    "TFD335",
    "warning",
    "OptimizerAudit",
    title=(
        "the LR has not moved since the first step and sits below half the scheduler's base LR: a step-sized "
        "warm-up stepped per epoch"
    ),
    trigger=(
        "a transformer's LR unchanged from the first step to the next measured step and below half of its "
        "schedulers' `base_lrs` (reported instead of TFD330)"
    ),
    hint=(
        "A warm-up or schedule sized in optimizer steps needs `'interval': 'step'` in the lr_scheduler dict that "
        "configure_optimizers returns (Lightning's default, also for a bare scheduler, is 'epoch': one step of "
        "the schedule per epoch). If the schedule is meant per epoch, its first epochs run at this LR."
    ),
    reason=(
        "Measured: the learning rate has not moved from a fraction of the one configured, so the warm-up is frozen"
    ),
)

TFD336 = Rule(
    "TFD336",
    "warning",
    "OptimizerAudit",
    title="weight decay that shrinks weights by more than 5e-3 of themselves per step (`lr * weight_decay`)",
    trigger=(
        "decoupled (AdamW) or SGD weight decay with `lr * weight_decay > 5e-3` per step (the scheduler's "
        "`initial_lr` when there is one): weights halve in under ~140 steps without gradients"
    ),
    hint=(
        "Decoupled decay acts as lr x weight_decay per step; transformer recipes sit around 1e-5 to 1e-4 (AdamW "
        "lr 3e-4, weight_decay 0.1). A weight_decay of several units is usually an L2 coefficient or a percentage"
        " put in the wrong place; with a usual weight_decay, the learning rate itself is far too high "
        "(UpdateRatio shows what it does to the weights)."
    ),
    reason=(
        "At this rate decay alone halves every decayed weight in under 140 steps, so decay rather than the loss "
        "sets their scale"
    ),
)

BLOCK = ("TFD320", "TFD339")
"""The codes reserved for OptimizerAudit's rules."""

RULES: tuple[Rule, ...] = (
    TFD320,
    TFD321,
    TFD322,
    TFD323,
    TFD324,
    TFD325,
    TFD326,
    TFD327,
    TFD328,
    TFD329,
    TFD330,
    TFD331,
    TFD332,
    TFD333,
    TFD334,
    TFD335,
    TFD336,
)
"""The rules decided in this module, in code order."""


SHRINK = 0.1
"""``TFD324`` as a warning when the decayed 1-D parameters' norm fell by more than this fraction of its first measured
value. Measured (TinyGPT, ``AdamW(model.parameters())``, 120 steps, 10-step warm-up): the recipes' decay
(``weight_decay`` 0.01 to 0.1 at lr 3e-4 to 2e-3) leaves that norm 1% to 3% *above* its first value; decay 1.0 at lr
3e-3 takes it 20% below, 3.0 takes it 50% below."""
DECAY_SHARE = 0.5
"""... and the decay alone would have shrunk the norm by at least this share of the measured fall:
``1 - exp(-sum of lr * weight_decay over the steps)`` (without gradients, decoupled decay multiplies every decayed
weight by ``1 - lr * weight_decay`` per step)."""


def decay_shrinkage(exposure: float) -> float:
    """The fraction of their norm that decoupled decay alone takes from weights over steps whose ``lr *
    weight_decay`` add up to ``exposure``."""
    return 1.0 - math.exp(-max(exposure, 0.0))


def decayed_norms_shrink(
    first: tuple[int, float], latest: tuple[int, float], exposure: float, evidence: dict[str, Any]
) -> Verdict | None:
    """``TFD324`` (warning): the decayed 1-D parameters' norm (``(step, norm)`` at the first and the latest
    measurement) fell by more than :data:`SHRINK`, and the decay's ``exposure`` (``sum lr * weight_decay`` between
    them) accounts for :data:`DECAY_SHARE` of the fall. None otherwise."""
    (first_step, first_norm), (step, norm) = first, latest
    if not (math.isfinite(first_norm) and math.isfinite(norm) and first_norm > 0 and step > first_step):
        return None
    fall = 1.0 - norm / first_norm
    by_decay = decay_shrinkage(exposure)
    if fall <= SHRINK or by_decay < DECAY_SHARE * fall:
        return None
    return Verdict(
        "TFD324",
        f"Weight decay is shrinking the one-dimensional parameters (norm gains, biases): their norm fell from "
        f"{first_norm:.4g} at step {first_step} to {norm:.4g} at step {step} ({fall:.1%}), and the decay alone takes "
        f"{by_decay:.1%} over those steps (lr x weight_decay adds up to {exposure:.3g}). Norm gains pulled towards 0 "
        "scale every normalised activation down.",
        {
            **evidence,
            "first_step": first_step,
            "first_norm": first_norm,
            "step": step,
            "norm": norm,
            "fall": fall,
            "decay_exposure": exposure,
            "decay_shrinkage": by_decay,
        },
        severity="warning",
    )
