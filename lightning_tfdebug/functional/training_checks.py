"""OptimizerAudit's rules on how training runs: the model's train mode, the learning-rate schedule (warm-up, a
scheduler stepped too often, an LR at zero or frozen, a warm-up longer than the run) and the step itself (a parameter
that never changes, gradients never zeroed). Host numbers and a schedule's replayed course in, verdicts out; the rules
on parameters and groups are in :mod:`~lightning_tfdebug.functional.optimizer_checks`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.optimizer_checks import shown
from lightning_tfdebug.functional.optimizers import ScheduleCourse, ScheduleReading
from lightning_tfdebug.functional.verdicts import Rule, Verdict

SAME_LR = 1e-9
"""Relative tolerance within which two learning rates are the same (a warm-up raises the LR by far more)."""

# ---------------------------------------------------------------------------------------- train mode
TFD327 = Rule(
    "TFD327",
    "error",
    "OptimizerAudit",
    title="the module is in eval mode at a training batch",
    headline="the module is in eval mode at a training batch (step {global_step})",
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
    headline="LR scheduler {scheduler} stepped {per_step} times per optimizer step",
    chart=EvidenceChart("How does the learning rate move?", "learning rate", logged=("optimizer_audit/lr/<group>",)),
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


WARMUP_SPIKED = (
    "No learning-rate warm-up, and the early loss spiked: {spike}, with the LR at its peak from the first step "
    "({first_lr:.3g})."
)
"""``TFD330``'s sentence as a warning."""


TFD330 = Rule(
    "TFD330",
    "info",
    "OptimizerAudit",
    title="no learning-rate warm-up on a transformer (a warning once the early loss spikes)",
    headline="no learning-rate warm-up: the LR starts at {first_lr:.3g}",
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
    headline="the LR reached zero at step {step} of {total}",
    chart=EvidenceChart(
        "When does the learning rate reach zero?",
        "learning rate",
        logged=("optimizer_audit/lr/<group>",),
    ),
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
    headline="the LR has not moved since step 0 and sits at {share:.1%} of the base LR {base_lr:.3g}",
    chart=EvidenceChart("Does the learning rate move?", "learning rate", logged=("optimizer_audit/lr/<group>",)),
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
    headline="the LR stays below half its peak {peak:.3g} for most of the run (reaches {run_max:.3g})",
    chart=EvidenceChart(
        "Does the learning rate reach its peak within the run?",
        "learning rate",
        logged=("optimizer_audit/lr/<group>",),
        lines=("peak",),
    ),
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
    headline="parameter `{parameter}` byte-identical after {steps} steps",
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
    headline="gradients not zeroed between optimizer steps (step {global_step})",
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
"""OptimizerAudit's codes (shared with :mod:`~lightning_tfdebug.functional.optimizer_checks`)."""

RULES: tuple[Rule, ...] = (TFD327, TFD328, TFD329, TFD330, TFD331, TFD335, TFD337, TFD332, TFD334)
"""The rules decided in this module, in code order."""
