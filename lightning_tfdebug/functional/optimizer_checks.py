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

from lightning_tfdebug.functional.optimizers import GroupReading, WiringReading
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
    headline="{count} trainable parameters are in no param group",
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
    headline="{count} parameters in more than one param group or optimizer",
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


FROZEN_MOVED = (
    "Frozen parameter {parameter} (requires_grad=False) changed at an optimizer step: this optimizer steps frozen "
    "parameters (weight decay or momentum without a gradient, or a gradient set by hand), so the weights meant to "
    "stay fixed drift."
)
"""``TFD322``'s sentence as a warning."""


TFD322 = Rule(
    "TFD322",
    "info",
    "OptimizerAudit",
    title="frozen parameters still in the optimizer (a warning once one of them moves)",
    headline="{count} frozen parameters are still in the optimizer: {shown}",
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
    headline="the optimizer holds {count} tensors that are not parameters of the module",
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


NORMS_SHRINK = (
    "Weight decay is shrinking the one-dimensional parameters (norm gains, biases): their norm fell from "
    "{first_norm:.4g} at step {first_step} to {norm:.4g} at step {step} ({fall:.1%}), and the decay alone takes "
    "{decay_shrinkage:.1%} over those steps (lr x weight_decay adds up to {decay_exposure:.3g}). Norm gains pulled "
    "towards 0 scale every normalised activation down."
)
"""``TFD324``'s sentence as a warning."""


TFD324 = Rule(
    "TFD324",
    "info",
    "OptimizerAudit",
    title="weight decay on 1-D parameters (norm weights, biases); a warning once they are measured to shrink",
    headline="weight decay {weight_decay:g} on {count} 1-D parameters (norm weights, biases)",
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


def _coupled(group: GroupReading) -> bool:
    """The group's decay is L2 added to the gradient, which an adaptive optimizer rescales."""
    return group.optimizer in COUPLED_DECAY and not group.decoupled


TFD326 = Rule(
    "TFD326",
    "info",
    "OptimizerAudit",
    title="Adam-family optimizer with `weight_decay > 0` (coupled L2): use AdamW",
    headline="{optimizer} with weight_decay={weight_decay:g} is coupled L2: use AdamW",
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
    headline="{optimizer} over float16 with eps={eps:g}: the moments underflow",
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
    headline="weight decay shrinks the weights by {decay_per_step:.3g} per step (lr {lr:.3g} x wd {weight_decay:g})",
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


BLOCK = ("TFD320", "TFD339")
"""The codes reserved for OptimizerAudit's rules."""

RULES: tuple[Rule, ...] = (TFD320, TFD321, TFD322, TFD323, TFD324, TFD325, TFD326, TFD333, TFD336)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "optimizer covers the parameters": (
        "TFD320",
        "TFD321",
        "TFD322",
        "TFD323",
        "TFD332",
        "TFD334",
    ),
    "train mode": (
        "TFD327",
        "TFD328",
    ),
    "learning-rate schedule": (
        "TFD329",
        "TFD330",
        "TFD331",
        "TFD335",
        "TFD337",
    ),
    "weight decay and optimizer settings": (
        "TFD324",
        "TFD325",
        "TFD326",
        "TFD333",
        "TFD336",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
