"""OptimizerAudit's rules, without a Trainer: a :class:`~lightning_tfdebug.functional.optimizers.WiringReading`, a
schedule's replayed course and host floats in, verdicts out. Rules escalated by the run's own evidence (TFD322,
TFD324, TFD330) carry their warning sentence as a template beside them (:data:`FROZEN_MOVED`, :data:`NORMS_SHRINK`,
:data:`WARMUP_SPIKED`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_tfdebug.functional.optimizers import GroupReading, ScheduleCourse, ScheduleReading, WiringReading
from lightning_tfdebug.functional.verdicts import Rule, Verdict

COUPLED_DECAY = frozenset({"Adam", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop"})
"""Optimizers whose ``weight_decay`` is L2 added to the gradient (coupled), unless ``decoupled_weight_decay`` is set."""
FP16_SQ_UNDERFLOW_GRAD = 1.7e-4
"""Gradients below this square to less than float16's smallest subnormal (about 6e-8)."""
HALF_EPS_STEP_FACTOR = 10.0
"""``TFD333`` when an underflowed second moment can make a step this many times Adam's normal one."""
DECAY_PER_STEP = 5e-3
"""``TFD336`` when ``lr * weight_decay`` exceeds this: weights halve in under ~140 steps (recipes use 1e-5 to 1e-4)."""
SHRINK = 0.1
"""``TFD324`` as a warning when the decayed 1-D parameters' norm fell by over this fraction of its first value..."""
DECAY_SHARE = 0.5
"""... and the decay alone (``1 - exp(-sum lr * weight_decay)``) accounts for at least this share of the fall."""
SAME_LR = 1e-9
"""Relative tolerance within which two learning rates are the same (a warm-up raises the LR by far more)."""


def shown(names: Sequence[str], limit: int = 8) -> str:
    """The first ``limit`` names, joined, and how many more there are."""
    text = ", ".join(names[:limit])
    return text + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _listed(rule: Rule, names: Sequence[str]) -> Verdict | None:
    """``rule``'s verdict on the parameters ``names`` (their count, the first 50 in the evidence); None without any."""
    return rule.verdict({"count": len(names), "names": list(names[:50])}, shown=shown(names)) if names else None


# ---------------------------------------------------------------------------------------- parameters and groups
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
    message="{count} trainable parameters are in no optimizer param group and will never change: {shown}.",
)


def untrained_parameters(names: Sequence[str]) -> Verdict | None:
    """``TFD320``: trainable parameters in no param group (``names``). None when there are none."""
    return _listed(TFD320, names)


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
    message="{count} parameters appear in more than one param group or optimizer: {shown}.",
)


def parameters_held_twice(names: Sequence[str]) -> Verdict | None:
    """``TFD321``: parameters in more than one param group or optimizer. None when there are none."""
    return _listed(TFD321, names)


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
    message=(
        "{count} frozen parameters (requires_grad=False) are in the optimizer: {shown}. Torch optimizers skip "
        "parameters without a gradient, so they stay put unless this optimizer steps them anyway (checked on "
        "measuring steps)."
    ),
    details=(
        "Checked once at the start of training (after a checkpoint is restored): frozen parameters (requires_grad "
        "False) held by an optimizer. Info, since torch's optimizers skip a parameter whose `.grad` is None (a LoRA "
        "fine-tune whose optimizer was built from `model.parameters()` is harmless); a warning when a measured step "
        "changes one of them: one frozen parameter the optimizer holds is copied before the step and compared byte "
        "for byte after it, on measuring steps (an optimizer that decays or moves parameters without a gradient)."
    ),
)


FROZEN_MOVED = (
    "Frozen parameter {parameter} (requires_grad=False) changed at an optimizer step: this optimizer steps frozen "
    "parameters (weight decay or momentum without a gradient, or a gradient set by hand), so the weights meant to "
    "stay fixed drift."
)
"""``TFD322``'s sentence as a warning."""


def frozen_parameters_held(names: Sequence[str]) -> Verdict | None:
    """``TFD322`` (info): frozen parameters the optimizer holds. None when there are none."""
    return _listed(TFD322, names)


def frozen_parameter_moved(name: str, changed: bool) -> Verdict | None:
    """``TFD322`` as a warning: the frozen parameter ``name`` ``changed`` across a measured optimizer step."""
    if not changed:
        return None
    evidence = {"parameter": name}
    return TFD322.verdict(evidence, severity="warning", key="moved", message=FROZEN_MOVED.format(**evidence))


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
    message=(
        "The optimizer holds {count} tensors that are not parameters of the module: they are updated but the "
        "model never uses them."
    ),
)


def stale_tensors(count: int) -> Verdict | None:
    """``TFD323``: the optimizers hold ``count`` tensors that are not parameters of the module."""
    return TFD323.verdict({"count": count}) if count else None


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
    message=(
        "Weight decay {weight_decay:g} is applied to {count} one-dimensional parameters (norm weights, biases) in "
        "param group {group}: {shown}. Advice only while their norm is not measured to shrink (watched on "
        "measuring steps)."
    ),
    details=(
        "Checked at the start of training: weight decay > 0 on trainable 1-D parameters (norm weights and biases); "
        "frozen ones are skipped by the optimizer and not counted. Info, since the published recipes decay every "
        "parameter and, at their decay values and run lengths, nothing measurable happens to those parameters "
        "(TinyGPT, 120 steps: decay 0.01 to 0.1 at lr 3e-4 to 2e-3 leaves their norm 1% to 5% above its start). A "
        "warning when the run shows the harm: on measuring steps the norm of the decayed 1-D parameters is read (one "
        "foreach norm, in the step's one host transfer), and once it fell by more than 10% of its first measured "
        "value while the decay alone (`1 - exp(-sum of lr * weight_decay)` over those steps) accounts for at least "
        "half of that fall (decay 1.0 at lr 3e-3: 23% below, the decay alone 29%)."
    ),
)


NORMS_SHRINK = (
    "Weight decay is shrinking the one-dimensional parameters (norm gains, biases): their norm fell from "
    "{first_norm:.4g} at step {first_step} to {norm:.4g} at step {step} ({fall:.1%}), and the decay alone takes "
    "{decay_shrinkage:.1%} over those steps (lr x weight_decay adds up to {decay_exposure:.3g}). Norm gains pulled "
    "towards 0 scale every normalised activation down."
)
"""``TFD324``'s sentence as a warning."""


def decay_on_1d(group: GroupReading) -> Verdict | None:
    """``TFD324`` (info): the group decays trainable one-dimensional parameters. None when it decays none."""
    if not group.decayed_1d:
        return None
    evidence = {"group": group.label, "weight_decay": group.weight_decay, "count": len(group.decayed_1d)}
    return TFD324.verdict(evidence, key=group.label, shown=shown(group.decayed_1d))


def decayed_1d_evidence(groups: Iterable[GroupReading]) -> dict[str, Any]:
    """The evidence a ``TFD324`` warning carries about the groups that decay 1-D parameters ({} when none does)."""
    decaying = [g for g in groups if g.decayed_1d]
    if not decaying:
        return {}
    return {
        "groups": [g.label for g in decaying],
        "weight_decay": max(g.weight_decay for g in decaying),
        "count": sum(len(g.decayed_1d) for g in decaying),
    }


def decay_shrinkage(exposure: float) -> float:
    """The fraction of their norm that decoupled decay alone takes from weights over steps whose ``lr *
    weight_decay`` add up to ``exposure``."""
    return 1.0 - math.exp(-max(exposure, 0.0))


def decayed_norms_shrink(
    first: tuple[int, float], latest: tuple[int, float], exposure: float, evidence: Mapping[str, Any]
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
    evidence = {
        **evidence,
        "first_step": first_step,
        "first_norm": first_norm,
        "step": step,
        "norm": norm,
        "fall": fall,
        "decay_exposure": exposure,
        "decay_shrinkage": by_decay,
    }
    message = NORMS_SHRINK.format(**evidence)
    return TFD324.verdict(evidence, severity="warning", key="shrink", step=step, message=message)


@dataclass
class DecayedNormWatch:
    """The decayed 1-D parameters' norm over a run, for :func:`decayed_norms_shrink`: its first measured ``(step,
    norm)``, the decay's ``exposure`` since (``sum lr * weight_decay`` over the optimizer steps) and the step it was
    last added up to; ``evidence``: :func:`decayed_1d_evidence` of the groups that decay them."""

    first: tuple[int, float] | None = None
    exposure: float = 0.0
    last_step: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def add_exposure(self, rate: float, step: int) -> None:
        """Add ``rate`` (the strongest group's ``lr * weight_decay`` at ``step``) for every step since the last."""
        if self.last_step is not None and self.first is not None:
            self.exposure += rate * max(step - self.last_step, 0)
        self.last_step = step

    def observe(self, step: int, norm: float) -> Verdict | None:
        """The norm measured at ``step``: the first one is the reference; later ones are decided against it."""
        if self.first is None:
            self.first, self.exposure = (step, norm), 0.0
            return None
        return decayed_norms_shrink(self.first, (step, norm), self.exposure, self.evidence)


TFD325 = Rule(
    "TFD325",
    "info",
    "OptimizerAudit",
    title="weight decay on embedding tables",
    trigger="weight decay > 0 on embedding tables",
    hint="Many transformer recipes exclude embeddings from weight decay; check it is intended.",
    reason="A lint: common practice excludes embeddings from decay, but no harm is measured",
    message="Weight decay {weight_decay:g} is applied to embedding tables in param group {group}: {shown}.",
    details=(
        "Checked at the start of training: weight decay > 0 on trainable embedding tables (frozen ones are not "
        "counted)."
    ),
)


def decay_on_embeddings(group: GroupReading) -> Verdict | None:
    """``TFD325``: the group decays trainable embedding tables. None when it decays none."""
    if not group.decayed_embeddings:
        return None
    evidence = {"group": group.label, "weight_decay": group.weight_decay}
    return TFD325.verdict(evidence, key=group.label, shown=shown(group.decayed_embeddings))


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
    message=(
        "{optimizer} with weight_decay={weight_decay:g} adds L2 to the gradient, which the adaptive step then "
        "rescales: the decay is not the decoupled weight decay transformer recipes use (group {group})."
    ),
    details=(
        "Checked at the start of training: an Adam-family optimizer (`Adam`, `NAdam`, `RAdam`, `Adamax`, `Adagrad`, "
        "`Adadelta`, `RMSprop`) with `weight_decay > 0`, which is coupled L2 that the adaptive step rescales, not "
        "decoupled weight decay."
    ),
)


def _coupled(group: GroupReading) -> bool:
    """The group's decay is L2 added to the gradient, which an adaptive optimizer rescales."""
    return group.optimizer in COUPLED_DECAY and not group.decoupled


def coupled_l2(group: GroupReading) -> Verdict | None:
    """``TFD326``: an Adam-family group with ``weight_decay > 0`` and no ``decoupled_weight_decay``."""
    if not (group.weight_decay > 0 and _coupled(group)):
        return None
    evidence = {"optimizer": group.optimizer, "weight_decay": group.weight_decay, "group": group.label}
    return TFD326.verdict(evidence, key=group.optimizer)


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
    message=(
        "{optimizer} steps float16 parameters with eps={eps:g} (group {group}): its moments are float16 too, the "
        "second moment of any gradient below {underflow:.1e} underflows to 0, and {outcome}."
    ),
    details=(
        'Checked at the start of training: an Adam-family optimizer over float16 parameters (`precision="16-true"`) '
        "with `eps` below 1.7e-5. torch keeps the moments in the parameter's dtype, the squared gradient of anything "
        "below 1.7e-4 underflows to 0, and the step becomes `lr * m / eps`, over 10x Adam's normal step of about "
        "`lr`; with the default `eps=1e-8`, which rounds to 0 in float16, it divides by zero (one `AdamW` step on a "
        "float16 weight with gradient 1e-5 gives `-inf`)."
    ),
)


def half_eps(group: GroupReading) -> Verdict | None:
    """``TFD333``: an Adam-family group over float16 parameters (so float16 moments, whose ``g * g`` underflows
    below :data:`FP16_SQ_UNDERFLOW_GRAD`) with a small ``eps``."""
    if group.eps is None or not group.float16:
        return None
    eps16 = float(torch.tensor(group.eps, dtype=torch.float16))  # eps as float16 holds it (a CPU scalar)
    factor = FP16_SQ_UNDERFLOW_GRAD / eps16 if eps16 > 0 else math.inf
    if factor <= HALF_EPS_STEP_FACTOR:
        return None
    outcome = (
        "eps itself rounds to 0 in float16, so that step divides by zero (inf/nan weights)"
        if eps16 == 0
        else f"that step becomes lr * m / eps, up to {factor:.3g}x the normal Adam step"
    )
    evidence = {"optimizer": group.optimizer, "eps": group.eps, "group": group.label, "max_step_factor": factor}
    return TFD333.verdict(evidence, key=group.label, underflow=FP16_SQ_UNDERFLOW_GRAD, outcome=outcome)


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
    message=(
        "Weight decay {weight_decay:g} at a learning rate of {lr:.3g} shrinks every decayed weight by "
        "{decay_per_step:.3g} of itself per step (group {group}, {optimizer}): without gradients pushing back, "
        "weights halve every {halving:.0f} steps, so decay rather than the loss sets their scale."
    ),
    details=(
        "Checked at the start of training: decoupled (AdamW) or SGD weight decay with `lr * weight_decay` above 5e-3 "
        "per step: the weights halve in under about 140 steps unless gradients push back (recipes sit around 1e-5 to "
        "1e-4). The LR is the group's `initial_lr` when a scheduler recorded one (a warm-up's first LR is far below "
        "the peak)."
    ),
)


def decay_rate(group: GroupReading) -> Verdict | None:
    """``TFD336``: decoupled or SGD decay that shrinks every weight by more than :data:`DECAY_PER_STEP` of itself
    per step at the group's peak LR (coupled Adam L2 is ``TFD326``'s)."""
    if group.weight_decay <= 0 or _coupled(group) or group.lr is None:
        return None
    rate = group.lr * group.weight_decay
    if not rate > DECAY_PER_STEP:
        return None
    evidence = {"group": group.label, "weight_decay": group.weight_decay, "lr": group.lr, "decay_per_step": rate}
    return TFD336.verdict(evidence, key=group.label, optimizer=group.optimizer, halving=math.log(2) / rate)


def wiring_verdicts(reading: WiringReading) -> list[Verdict | None]:
    """Every rule on the wiring at the start of training: each group's decay and ``eps``, then the membership."""
    out: list[Verdict | None] = []
    for group in reading.groups:
        out += [decay_on_1d(group), decay_on_embeddings(group), half_eps(group), decay_rate(group), coupled_l2(group)]
    out += [
        untrained_parameters(reading.missing),
        parameters_held_twice(reading.twice),
        frozen_parameters_held(reading.frozen),
        stale_tensors(reading.strangers),
    ]
    return out


# ---------------------------------------------------------------------------------------- train mode
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
    message=(
        "The module is in eval mode at a training batch (epoch {epoch}, step {global_step}): dropout is off and "
        "batch norm uses frozen running statistics, so training is not the training you configured."
    ),
    details=(
        "Checked at the first batch of each epoch and the first batch after each validation run, once that batch's "
        "forward has run (so an `.eval()` from the LightningModule's own `on_train_batch_start` or from inside "
        "`training_step` is seen): the module is not in train mode."
    ),
)


def eval_mode(training: bool, epoch: int, step: int) -> Verdict | None:
    """``TFD327``: the module is not ``training`` at a training batch of ``epoch`` (recorded once per epoch)."""
    if training:
        return None
    return TFD327.verdict({"epoch": epoch}, key=f"epoch{epoch}", global_step=step)


TFD328 = Rule(
    "TFD328",
    "info",
    "OptimizerAudit",
    title="mode-dependent submodules in eval mode while the module trains",
    trigger="dropout / norm submodules in eval mode while the module trains",
    hint="Deliberate for frozen BatchNorm; otherwise a submodule was left in eval mode.",
    reason="An observation: deliberate for frozen normalisation layers, and no harm is measured",
    message="{count} mode-dependent submodules are in eval mode while the module trains: {shown}.",
    details=(
        "Checked at the same batches as TFD327: dropout or batch/instance-norm submodules in eval mode while the "
        "module trains (deliberate for frozen BatchNorm, hence info)."
    ),
)


def submodules_in_eval(names: Sequence[str]) -> Verdict | None:
    """``TFD328``: mode-dependent submodules (``names``) in eval mode while the module trains."""
    if not names:
        return None
    return TFD328.verdict({"count": len(names)}, shown=shown(names))


# ---------------------------------------------------------------------------------------- the learning rate
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
    message=(
        "The LR scheduler {scheduler} was stepped {per_step}: a schedule sized in optimizer steps runs that many "
        "times too fast."
    ),
    details=(
        "At each optimizer step it is called at, without touching a tensor: each LR scheduler's `last_epoch` (its "
        "count of `step()` calls) is compared with its value at the last reading, and more calls than optimizer steps"
        " in between fires (stepped per micro-batch under gradient accumulation, or by hand as well as by Lightning)."
        " On its own it reads at every step; inside `TFDebug` on measuring steps (and the steps with a check "
        'pending), so a scheduler stepped twice per step is named at the first measuring step after the first, as "2n'
        ' times over n optimizer steps".'
    ),
)


def scheduler_overstepped(scheduler: str, calls: int, steps: int, key: str | None = None) -> Verdict | None:
    """``TFD329``: a scheduler stepped ``calls`` times over ``steps`` steps of its optimizer, more than once each."""
    if steps <= 0 or calls <= steps:
        return None
    per_step = (
        f"{calls} times between two optimizer steps" if steps == 1 else f"{calls} times over {steps} optimizer steps"
    )
    evidence = {"calls": calls, "optimizer_steps": steps, "scheduler": scheduler}
    return TFD329.verdict(evidence, key=key, per_step=per_step)


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
    message=(
        "No learning-rate warm-up: the LR at step {step} ({lr:.3g}) is not above the LR of the first step "
        "({first_lr:.3g}), so this transformer starts at its peak LR. Advice only while the early loss stays "
        "well-behaved (watched for the first warmup_window steps)."
    ),
    details=(
        "A transformer (a model with an attention module) trained from step 0 whose LR at the next measured step is "
        "not above its first-step LR; a run too short for a second measurement decides at its end. Info (fine-tuning "
        "at a constant LR and small models train well without a warm-up); a warning when a measured loss within the "
        "first `warmup_window` (default 1000) steps shows what a warm-up prevents: not finite, more than 10% above "
        "the first step's loss, or doubled from its lowest measured value (and higher by 10% of the first loss). Not "
        "decided on a run resumed from a checkpoint without this callback's state (its first LR is past any warm-up)."
        " When the unchanged LR is below half of the schedulers' `base_lrs`, TFD335 is raised instead."
    ),
)


WARMUP_SPIKED = (
    "No learning-rate warm-up, and the early loss spiked: {spike}, with the LR at its peak from the first step "
    "({first_lr:.3g})."
)
"""``TFD330``'s sentence as a warning."""


def missing_warmup(first_lr: float, lr: float, step: int) -> Verdict | None:
    """``TFD330`` (info): a transformer's LR at a later step (``lr`` at ``step``) is not above its first-step LR.
    None when it rose, or when there was no first LR."""
    if not (first_lr > 0 and lr <= first_lr * (1 + SAME_LR)):
        return None
    return TFD330.verdict({"first_lr": first_lr, "lr": lr, "step": step})


def early_loss_spike(loss: float, first_loss: float, lowest_loss: float, step: int) -> dict[str, Any] | None:
    """What a warm-up prevents, seen in a loss measured early in the run: not finite, above the first step's loss by
    10%, or doubled from its lowest point (and higher by 10% of the first loss). The spike's evidence, or None."""
    if not math.isfinite(loss):
        spike = f"the loss at step {step} is {loss}"
    elif loss > 1.1 * first_loss:
        spike = f"the loss at step {step} ({loss:.4g}) rose above the first step's ({first_loss:.4g})"
    elif loss > 2.0 * lowest_loss and loss - lowest_loss > 0.1 * first_loss:
        spike = f"the loss at step {step} ({loss:.4g}) doubled from its lowest measured value ({lowest_loss:.4g})"
    else:
        return None
    return {"spike": spike, "loss": loss, "first_loss": first_loss, "lowest_loss": lowest_loss, "spike_step": step}


def warmup_spiked(no_warmup: Mapping[str, Any] | None, spike: Mapping[str, Any] | None) -> Verdict | None:
    """``TFD330`` as a warning: no warm-up (the info verdict's evidence) and an :func:`early_loss_spike`."""
    if no_warmup is None or spike is None:
        return None
    evidence = {**no_warmup, **spike}
    message = WARMUP_SPIKED.format(**evidence)
    return TFD330.verdict(evidence, severity="warning", key="spike", step=spike["spike_step"], message=message)


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
    message=(
        "The learning rate reached zero at step {step}, long before the end of the run ({total} steps): the "
        "remaining steps train nothing."
    ),
    details=("On a measuring step, when a param group's LR is zero before `zero_lr_fraction` of the run's steps."),
)


def lr_reached_zero(lr: float, peak_lr: float, step: int, total_steps: float, fraction: float) -> Verdict | None:
    """``TFD331``: the LR (``lr`` at ``step``) is zero against its ``peak_lr`` before ``fraction`` of the run."""
    if not (peak_lr > 0 and lr <= 1e-12 * peak_lr and step < fraction * float(total_steps)):
        return None
    total = int(total_steps) if total_steps != math.inf else "unbounded"
    return TFD331.verdict({"step": step, "total_steps": float(total_steps), "peak_lr": peak_lr}, total=total)


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
    message=(
        "The learning rate has not moved since the first step: at step {step} it is {lr:.3g}, {share:.1%} of the "
        "{base_lr:.3g} the optimizer was configured with, and the scheduler ({names}, interval {intervals}) has "
        "not raised it."
    ),
    details=(
        "As TFD330 (the LR has not moved between the first step and the next measured step), when that LR is below "
        "half of the schedulers' `base_lrs`: the schedule is not advancing rather than missing (a warm-up sized in "
        'steps returned as a bare scheduler or with `interval: "epoch"` holds its first value all epoch).'
    ),
)


def schedule_frozen(first_lr: float, lr: float, step: int, schedules: ScheduleReading | None) -> Verdict | None:
    """``TFD335`` (instead of ``TFD330``): the LR has not moved since the first step and sits below half of the
    schedulers' base LR (a step-sized warm-up stepped per epoch)."""
    if schedules is None or not first_lr > 0 or abs(lr - first_lr) > first_lr * SAME_LR:
        return None
    if not lr < 0.5 * schedules.base_lr:
        return None
    evidence = {
        "lr": lr,
        "base_lr": schedules.base_lr,
        "step": step,
        "interval": list(schedules.intervals),
        "schedulers": list(schedules.names),
    }
    names, intervals = ", ".join(schedules.names), "/".join(schedules.intervals)
    return TFD335.verdict(evidence, step=step, share=lr / schedules.base_lr, names=names, intervals=intervals)


MIN_RUN = 50
"""TFD337 judges runs of at least this many optimizer steps (shorter ones are trials, sized apart from the schedule)."""
RUN_SHARE = 0.5
"""TFD337 when a rising schedule first reaches half of its peak after this share of the run, or never in it."""

TFD337 = Rule(
    "TFD337",
    "warning",
    "OptimizerAudit",
    title="the LR schedule stays below half of its configured peak for most of the run: a warm-up longer than the run",
    trigger=(
        "replayed on a copy at the start of training, a rising LR schedule first reaches half of its configured "
        "peak (the largest base LR) after half of the run's remaining optimizer steps, or not at all (runs of 50 "
        "steps or more; off with `check_schedule_fits=False`, as in a preflight)"
    ),
    hint=(
        "Size the warm-up and every other phase of the schedule in optimizer steps of this run (warm-ups are "
        "usually 1-10% of max_steps), counting gradient accumulation and the number of devices; or give the run "
        "the length its schedule was written for."
    ),
    reason=(
        "Measured on the schedule itself: most of the run trains at a small fraction of the learning rate it was "
        "configured with"
    ),
    message=(
        "The learning rate stays below half of its configured peak ({peak:.3g}) {until}: {scheduler} (interval "
        "{interval}) reaches the peak {at}, and the highest LR of this run is {run_max:.3g} ({share:.1%} of it)."
    ),
    details=(
        "Checked once per fit: each LR scheduler is deep-copied with a stand-in optimizer holding copies of the param"
        " groups' settings (the module and the Trainer are shared, never copied), and the copy is stepped at "
        "Lightning's `interval` and `frequency` from the current step to `max_steps` (the Trainer's "
        "`estimated_stepping_batches`), and on until it reaches its configured peak (the largest base LR), at most "
        "100,000 scheduler steps. A schedule that rises and first reaches half of its peak only after half of the "
        "run, or never in it, fires. Runs under 50 steps are not judged; `tfdebug check` sets "
        "`check_schedule_fits=False`; a scheduler that cannot be replayed alone (one that needs a metric, such as "
        "`ReduceLROnPlateau`) is not judged."
    ),
)


def warmup_past_run(course: ScheduleCourse) -> Verdict | None:
    """``TFD337``: a rising schedule whose LR first reaches half of its peak after :data:`RUN_SHARE` of the run's
    remaining steps, or never in it. None for runs under :data:`MIN_RUN` steps."""
    steps, half = course.end - course.start, course.half_step
    if steps < MIN_RUN or not course.rises or (half is not None and half - course.start <= RUN_SHARE * steps):
        return None
    if half is not None and half <= course.end:
        until = f"until step {half} of this run's {course.end} ({(half - course.start) / steps:.0%} of it)"
    else:
        until = f"for the whole run ({course.end} steps)"
    at = f"at step {course.peak_step}" if course.peak_step is not None else f"not within {course.replayed} steps"
    evidence = {
        "scheduler": course.scheduler,
        "interval": course.interval,
        "peak": course.peak,
        "run_max": course.run_max,
        "half_step": half,
        "peak_step": course.peak_step,
        "run_end": course.end,
    }
    share = course.run_max / course.peak
    return TFD337.verdict(evidence, key=course.scheduler, until=until, at=at, share=share)


# ---------------------------------------------------------------------------------------- the step
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
    message=(
        "Parameter {parameter} was byte-identical after {steps} consecutive measured optimizer steps although it "
        "had a gradient and a non-zero learning rate."
    ),
    details=(
        "On measuring steps, one parameter per param group (the first with a gradient whose copy fits the memory "
        "budget, LR > 0) is copied before the step and compared byte for byte after it; unchanged on `patience` "
        "consecutive measured steps fires (an update that underflows bf16/fp16 weights, or an optimizer stepping "
        "other tensors). Steps the fp16 GradScaler skipped are not counted; a group where no parameter fits the "
        "budget is recorded once as not compared."
    ),
)


def parameter_unchanged(name: str, steps: int, patience: int) -> Verdict | None:
    """``TFD332``: the parameter ``name`` was byte-identical after ``steps`` consecutive measured steps (``patience``
    of them or more)."""
    if steps < patience:
        return None
    return TFD332.verdict({"parameter": name, "steps": steps}, key=name)


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
    message=(
        "Gradients were not zeroed after the optimizer step: at the first backward of step {global_step}, "
        "{groups_with_old_grads} of {groups_probed} param groups still hold the previous steps' gradients, so "
        "every step adds its gradient to all the earlier ones."
    ),
    details=(
        "At the first backward after an optimizer step, on measuring steps: the first trainable parameter of each "
        "param group must have no gradient left from before (Lightning's automatic optimization clears to None "
        "there). A `.grad` that exists is read (one host read) and non-zero values fire: a manual `training_step` "
        "that never calls `zero_grad` sums every step's gradient into all later ones. `zero_grad(set_to_none=False)` "
        "and manual accumulation windows are recognised as healthy."
    ),
)


def grads_not_zeroed(left: int, probed: int, step: int) -> Verdict | None:
    """``TFD334``: at the first backward of ``step``, ``left`` of the ``probed`` param groups still held the previous
    steps' gradients."""
    if not left:
        return None
    return TFD334.verdict({"groups_with_old_grads": left, "groups_probed": probed}, global_step=step)


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
    TFD337,
)
"""The rules decided in this module, in code order."""
