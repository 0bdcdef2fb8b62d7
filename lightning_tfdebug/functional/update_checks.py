"""UpdateRatio's decisions: updates too small or too large for the weights, groups that never change, weights that
inflate or deflate. Host numbers in, verdicts out; no Trainer.

Each measured optimizer step reaches :func:`update_verdicts` as an
:class:`~lightning_tfdebug.functional.updates.UpdateReading`, with the ``UpdateMemory`` of earlier measurements and
the ``GroupFacts`` read once with the groups (both in :mod:`~lightning_tfdebug.functional.updates`).
``docs/callbacks/update_ratio.md`` gives the measurements behind every threshold.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.learning import learned, progress
from lightning_tfdebug.functional.updates import (
    LOSS_FALL_PER_STEP,
    GroupFacts,
    UpdateMemory,
    UpdateReading,
    below_resolution,
    expected_step,
    loss_fall_per_step,
    loss_still_falling,
)
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.tracking import Streak

GROWTH_FLOOR = 0.05
"""TFD313/TFD314 judge only groups whose norm at the start of the window is above this fraction of the largest
group's (a zero-initialised bias grows from nothing under any learning rate)."""


# ---------------------------------------------------------------------------------------------- TFD310 and TFD312
def stuck_groups(reading: UpdateReading, streak: Streak, *, patience: int) -> list[str]:
    """The groups that got gradients and did not change while the optimizer stepped (some group changed),
    ``patience`` measurements in a row."""
    stepped = sum(reading.delta_sq.values()) > 0 if reading.stepped is None else reading.stepped
    stuck = []
    for g in reading.delta_sq:
        unchanged = stepped and reading.grad_sq[g] > 0 and reading.delta_sq[g] == 0.0
        if streak.update(f"zero:{g}", unchanged) >= patience:
            stuck.append(g)
    return stuck


def left_out_or_rounded(
    stuck: Sequence[str], reading: UpdateReading, facts: GroupFacts, param_groups: Sequence[Mapping[str, Any]]
) -> tuple[list[str], dict[str, dict[str, float]]]:
    """Of the ``stuck`` groups, those left out of the optimizer (TFD312), and those whose expected step is below half
    the float spacing of their weights (they rounded back: TFD310's evidence). When membership cannot be told, a
    group whose step should have shown is left out. ``param_groups`` is read only when a group is stuck."""
    if not stuck:
        return [], {}
    settings = {id(p): (float(group["lr"]), "betas" in group) for group in param_groups for p in group["params"]}
    left_out, rounded = [], {}
    for name in stuck:
        if facts.outside is not None and facts.outside[name]:
            left_out.append(name)
            continue
        held = [settings[i] for i in facts.params[name] if i in settings]
        if not held:  # the optimizer holds copies: judge by the most generous of its param groups
            held = list(set(settings.values()))
        numel = max(facts.numel[name], 1)
        weight_rms = math.sqrt(reading.param_norms[name] ** 2 / numel)
        grad_rms = math.sqrt(reading.grad_sq[name] / numel)
        step = max((expected_step(lr, adaptive, grad_rms) for lr, adaptive in held), default=0.0)
        if held and below_resolution(step, weight_rms, facts.eps[name]):
            rounded[name] = {"expected_step": step, "half_spacing": facts.eps[name] * weight_rms / 2}
        elif facts.outside is None:
            left_out.append(name)
    return left_out, rounded


# ---------------------------------------------------------------------------------------------------------- TFD310


def _learning_evidence(memory: UpdateMemory, latest: float, ln_vocab: float | None) -> dict[str, Any]:
    if memory.first_loss is None or ln_vocab is None:
        return {}
    return {
        "first_loss": memory.first_loss,
        "ln_vocab": ln_vocab,
        "unigram_entropy": memory.unigram,
        "progress_first": progress(memory.first_loss, ln_vocab, memory.unigram),
        "progress_latest": progress(latest, ln_vocab, memory.unigram),
    }


TFD310 = Rule(
    "TFD310",
    "warning",
    "UpdateRatio",
    title="updates too small for the LR the schedule reaches, and the loss barely moves: LR too low",
    headline="updates too small: update ratio {update_ratio:.3g} below {band[low]:g} at LR {lr:.3g}",
    chart=EvidenceChart(
        "Are the updates inside the healthy band?",
        "update / weight",
        logged=("update_ratio/total",),
        lines=("band.low", "band.high"),
        log_scale=True,
    ),
    trigger=(
        "update:weight ratio below `low` for `patience` measurements, judged at the LR's plateau (not decayed below "
        "`decayed_lr_fraction` of its peak) or, while the LR still rises, scaled to the highest LR the schedule "
        "reaches in this run (replayed on a copy); over them the mean training loss fell by less than 0.1% of "
        "itself per step, and the model has not learned: its first measured loss made less than 0.35 of the way "
        "from ln(V) to the labels' unigram entropy (a fine-tune starts most of the way down) and its latest loss "
        "is not below that entropy (`lightning_tfdebug.functional.learning`)"
    ),
    hint=(
        "The learning rate is probably too low (with AdamW, ratio ~ lr / rms(W)). Raise it, or run an LR range "
        "test; check that the scheduler is not stuck at its initial factor and that its warm-up fits in the run. "
        "Groups named in `groups_below_resolution` did not change at all: the optimizer stepped them by less than "
        "half the float spacing of their weights (AdamW at lr 1e-8 on fp32 norm gains of 1.0), and they rounded back."
    ),
    reason="Measured: updates too small to move the weights, and the loss shows the model has not learned",
    message=(
        "Updates are tiny: ||dW||/||W|| = {update_ratio:.3g} (healthy band {band[low]:g} to {band[high]:g}) for "
        "{patience} measurements at a learning rate of {lr:.3g}{planned}{loss_falls}{not_learned}{rounded}."
    ),
    details=(
        "When the update ratio `‖ΔW‖ / ‖W‖` (the change the optimizer step really made) stays below `low` (default "
        "3e-4) for `patience` (default 3) measurements in a row, and all of: the LR has not been decayed by a "
        "schedule below `decayed_lr_fraction` (default 0.5) of its peak; during a warm-up, the ratio scaled by the "
        "highest LR the schedule reaches in this run over the current LR is still below `low` (each LR scheduler is "
        "replayed once per fit on a copy stepping a stand-in optimizer, to the run's last step); the training loss "
        "shows the harm: over the low streak its mean falls by less than 0.1% of itself per step; and the model has "
        "not learned, in the pack's one reading (`lightning_tfdebug.functional.learning`, shared with LossAtInit): "
        "its progress is where the loss sits from ln(V) (0) to the supervised labels' unigram entropy H (1; V from "
        "the input embedding, H counted over the labels of the first 8 measured batches), and the model learned when "
        "its first measured loss made 0.35 of that way (a fine-tune) or its latest loss is below H by a tenth of the "
        "way. Without a vocabulary or a loss, the ratio and the loss's fall decide. A group that never changes "
        "although the optimizer holds it is compared with its weights' float resolution: when its expected step (the "
        "largest LR of its param groups, times `rms(grad)` for an optimizer without `betas`) is below half a float "
        "spacing, `eps * rms(W) / 2`, it is named in this finding's `groups_below_resolution` (`expected_step`, "
        "`half_spacing`)."
    ),
)


def tiny_updates(
    reading: UpdateReading,
    memory: UpdateMemory,
    rounded: Mapping[str, Mapping[str, float]],
    *,
    low: float,
    high: float,
    patience: int,
    decayed_lr_fraction: float,
    ln_vocab: float | None,
    planned_lr: float | None = None,
) -> Verdict | None:
    """TFD310: the total ratio below ``low`` for ``patience`` measurements while the mean loss barely falls and the
    model has not learned (unknown without a loss or ln(V)). Judged at the LR's plateau, or, while the LR rises
    towards ``planned_lr`` (the highest LR the schedule reaches in this run), on the ratio scaled to it: the update
    grows with the LR. ``rounded``: the stuck groups whose updates round away, named."""
    rising = planned_lr is not None and 0 < reading.lr < planned_lr and reading.lr >= memory.peak_lr
    target = planned_lr if rising and planned_lr is not None else reading.lr
    ratio = reading.total * target / reading.lr if rising else reading.total
    low_streak = memory.streak.update("low", ratio < low) >= patience
    mean, first = reading.mean_loss, memory.first_loss
    has_learned = first is not None and ln_vocab is not None and bool(learned(first, mean, ln_vocab, memory.unigram))
    if not low_streak or not (rising or memory.at_plateau(reading.lr, decayed_lr_fraction)):
        return None
    if loss_still_falling(memory.losses) or has_learned:
        return None
    fall, since = loss_fall_per_step(memory.losses), memory.losses[0][0]
    loss_falls = (
        f", while the mean training loss fell by only {fall:.3%} of itself per step since step {since} "
        f"(a loss the updates move falls by {LOSS_FALL_PER_STEP:.1%} per step or more)"
        if math.isfinite(fall)
        else ""
    )
    not_learned = ""
    if ln_vocab is not None and first is not None and math.isfinite(mean):
        not_learned = (
            f"; the loss ({mean:.3f}, {first:.3f} at the first measurement) is still near ln(V) = {ln_vocab:.3f}: "
            "the model has not learned"
        )
    rounding = ""
    if rounded:
        rounding = (
            f"; group(s) {', '.join(rounded)} did not change at all: they are in the optimizer, but each step is "
            "below half the float spacing of their weights, which round back"
        )
    planned = f" (still rising: {ratio:.3g} at the {target:.3g} the schedule reaches in this run)" if rising else ""
    evidence = {
        "update_ratio": reading.total,
        "lr": reading.lr,
        "band": {"low": low, "high": high},
        "groups_below": [g for g, value in reading.ratios.items() if value < low],
        "groups_below_resolution": dict(rounded),
        "loss_fall_per_step": fall,
        **({"planned_lr": target, "ratio_at_planned_lr": ratio} if rising else {}),
        **_learning_evidence(memory, mean, ln_vocab),
    }
    return TFD310.verdict(
        evidence,
        step=reading.step,
        patience=patience,
        planned=planned,
        loss_falls=loss_falls,
        not_learned=not_learned,
        rounded=rounding,
    )


# ---------------------------------------------------------------------------------------------------------- TFD311
TFD311 = Rule(
    "TFD311",
    "warning",
    "UpdateRatio",
    title="one step rewrote a large part of the weights: LR too high / no warm-up",
    headline="one step rewrote the weights: update ratio {update_ratio:.3g} above {band[high]:g} (LR {lr:.3g})",
    chart=EvidenceChart(
        "Are the updates inside the healthy band?",
        "update / weight",
        logged=("update_ratio/total",),
        lines=("band.low", "band.high"),
        log_scale=True,
    ),
    trigger="update:weight ratio above `high` on any measurement",
    hint=(
        "The learning rate is probably too high, or there is no warm-up: each step rewrites a large part of the "
        "weights. Lower the LR or add warm-up; GradNormMonitor shows whether gradients explode too."
    ),
    reason="Measured: one optimizer step rewrote a large part of the weights",
    message=(
        "Updates are huge: one optimizer step changed the weights by ||dW||/||W|| = {update_ratio:.3g} (healthy band "
        "{band[low]:g} to {band[high]:g}) at a learning rate of {lr:.3g}."
    ),
    details=(
        "When the update ratio of any single measured step is above `high` (default 0.3); no patience: a learning "
        "rate 100x too high shows its damage on the first steps, after which the grown weights make the ratio look "
        "ordinary."
    ),
)


def huge_update(reading: UpdateReading, *, low: float, high: float) -> Verdict | None:
    """TFD311: one step's total ratio above ``high`` (a step that rewrites this much of the weights is damage
    already: no patience). Not judged on a step whose snapshot covered no group."""
    if reading.total <= high or not reading.ratios:
        return None
    evidence = {
        "update_ratio": reading.total,
        "lr": reading.lr,
        "band": {"low": low, "high": high},
        "groups_above": [g for g, ratio in reading.ratios.items() if ratio > high],
    }
    return TFD311.verdict(evidence, step=reading.step)


# ---------------------------------------------------------------------------------------------------------- TFD312
TFD312 = Rule(
    "TFD312",
    "error",
    "UpdateRatio",
    title="a group got gradients but did not change: not in the optimizer",
    headline="groups got gradients but did not change (not in the optimizer): {names}",
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
    message=(
        "Group(s) {names} received gradients but did not change when the optimizer stepped, {patience} times in a "
        "row: their parameters are in none of the optimizer's param groups."
    ),
    details=(
        "When a group that receives gradients does not change at all for `patience` (default 3) of its measurements, "
        "and its parameters are in no param group of any optimizer (compared by identity, once per fit, host-side). A"
        " group wholly in the optimizer that does not change is TFD310's `groups_below_resolution` when its expected "
        "step is below half its weights' float spacing, and nothing otherwise (a param group at lr 0). When the "
        "optimizer holds copies of the parameters (none found in it by identity), the resolution comparison decides "
        "instead: a stuck group whose step should have shown gets TFD312. With the snapshot taken in parts "
        "(`memory_budget_mb`), `patience` counts the measurements of that group."
    ),
)


def not_in_optimizer(left_out: Sequence[str], reading: UpdateReading, *, patience: int) -> Verdict | None:
    """TFD312: the groups ``left_out`` of every optimizer (:func:`left_out_or_rounded`), named with their gradient
    norms."""
    if not left_out:
        return None
    evidence = {"groups": list(left_out), "grad_norms": {g: reading.grad_sq[g] ** 0.5 for g in left_out}}
    return TFD312.verdict(evidence, step=reading.step, names=", ".join(left_out), patience=patience)


# ---------------------------------------------------------------------------------------------------------- TFD313


@dataclass(frozen=True)
class NormChange:
    """How the group weight norms changed over the growth window: ``growth`` per group judged (the norm now over the
    norm at ``from_step``), its median, and the mean loss at both ends (NaN: none returned)."""

    from_step: int
    to_step: int
    median: float
    growth: dict[str, float]
    from_loss: float = math.nan
    to_loss: float = math.nan

    def evidence(self, largest_first: bool) -> dict[str, Any]:
        """The evidence TFD313 and TFD314 share: the median and each group's growth, ordered by it."""
        ordered = sorted(self.growth.items(), key=lambda kv: -kv[1] if largest_first else kv[1])
        growth = {g: round(v, 4) for g, v in ordered}
        return {"median_growth": self.median, "from_step": self.from_step, "to_step": self.to_step, "growth": growth}


def norm_change(
    window: deque[tuple[int, dict[str, float], float]],
    norms: Mapping[str, float],
    step: int,
    *,
    growth_window: int,
    loss: float = math.nan,
) -> NormChange | None:
    """Add the group ``norms`` and mean ``loss`` of ``step`` to ``window`` (dropping what is older than
    ``growth_window`` steps) and compare them with the window's oldest; None when there is nothing to compare (no
    earlier step, no group above :data:`GROWTH_FLOOR` of the largest at the start)."""
    while window and window[0][0] < step - growth_window:
        window.popleft()
    window.append((step, dict(norms), loss))
    start_step, start, start_loss = window[0]
    if start_step == step:
        return None
    largest = max(start.values(), default=0.0)
    growth = {
        g: norms[g] / start[g]
        for g in norms
        if g in start and start[g] > GROWTH_FLOOR * largest and start[g] > 0 and math.isfinite(norms[g])
    }
    if not growth:
        return None
    return NormChange(start_step, step, statistics.median(growth.values()), growth, start_loss, loss)


def growth_harm(change: NormChange, reading: UpdateReading, *, high: float, growth_limit: float) -> str | None:
    """What shows harm beside weight growth: a loss that is not finite or fell by less than
    :data:`LOSS_FALL_PER_STEP` per step over the window, updates above ``high``, or growth past ``growth_limit``
    squared (weights inflating, not leaving a small init); None otherwise."""
    if math.isfinite(change.from_loss) and not math.isfinite(change.to_loss):
        return f"the mean training loss went from {change.from_loss:.4g} to {change.to_loss}"
    fall = loss_fall_per_step([(change.from_step, change.from_loss), (change.to_step, change.to_loss)])
    if math.isfinite(fall) and fall < LOSS_FALL_PER_STEP:
        moved = f"fell by only {fall:.3%}" if fall >= 0 else f"rose by {-fall:.3%}"
        return f"the mean training loss {moved} of itself per step over those steps"
    if reading.total > high:
        return f"one step changed the weights by ||dW||/||W|| = {reading.total:.3g}, above the band"
    if change.median > growth_limit**2:
        return f"the growth is past {growth_limit**2:g}x, beyond what weights leaving a small init show"
    return None


TFD313 = Rule(
    "TFD313",
    "info",
    "UpdateRatio",
    title=(
        "the weights inflate (median group norm grew > `growth_limit` x in `growth_window` steps); a warning with "
        "harm beside it: LR far too high"
    ),
    headline="the weights inflate: median group norm grew {median_growth:.3g}x in {steps} steps (LR {lr:.3g})",
    chart=EvidenceChart("Do the weights grow?", "L2 norm", logged=("update_ratio/param_norm/total",)),
    trigger=(
        "the median group weight norm grew more than `growth_limit` x within `growth_window` optimizer steps "
        "(groups under 5% of the largest group's norm left out); a warning when, beside it, the mean training "
        "loss is not finite or fell by less than 0.1% of itself per step over the same window, the update ratio is "
        "above `high`, or the growth is past `growth_limit` squared"
    ),
    hint=(
        "Each step moves the weights a lot against their own scale (Adam moves every weight by about the LR per "
        "step), so they inflate instead of learning; the loss typically stalls on a plateau or spikes. The "
        "learning rate is probably far too high: transformers trained with AdamW usually peak between 1e-4 and "
        "1e-3 (a few times more for tiny models). Lower it, and keep a warm-up. Norms of small-initialised "
        "weights also grow early in healthy training while the loss falls: that alone is info."
    ),
    reason=(
        "Small-initialised weights grow early in healthy training; a warning only with harm beside the growth (a "
        "loss that stopped falling, or updates above the band)"
    ),
    message=(
        "Weights are growing fast: the median group norm grew {median_growth:.3g}x in {steps} optimizer steps (limit "
        "{growth_limit:g}x in {growth_window}), at a learning rate of {lr:.3g}{beside}."
    ),
    details=(
        "When the median group's weight norm `‖W‖` grew more than `growth_limit` (default 2) times over at most "
        "`growth_window` (default 50) optimizer steps. Groups under 5% of the largest group's norm at the start of "
        "the window are left out (a zero-initialised bias grows from nothing under any LR). Info by default, since "
        "weights initialised small grow early in healthy training (a Gemma tiny config grows 3.0x over its first 50 "
        "steps while its loss falls from 5.54 to 3.03); a warning when harm shows beside the growth over the same "
        "window: the mean training loss fell by less than 0.1% of itself per step (or rose, or is not finite), the "
        "step's ratio is above `high`, or the growth is past `growth_limit` squared (a learning rate 100x too high "
        "inflates the weights 4.6x to 10x within 25 steps)."
    ),
)


def weights_growing(
    change: NormChange | None, reading: UpdateReading, harm: str | None, *, growth_limit: float, growth_window: int
) -> Verdict | None:
    """TFD313: the median group norm grew past ``growth_limit`` x within the window; a warning with ``harm`` (what
    :func:`growth_harm` found), else info."""
    if change is None or change.median <= growth_limit:
        return None
    evidence = {**change.evidence(largest_first=True), "lr": reading.lr, "harm": harm}
    beside = f", and {harm}" if harm else ", while the loss still falls (early growth of small-initialised weights)"
    window = {"steps": change.to_step - change.from_step, "growth_limit": growth_limit, "growth_window": growth_window}
    severity, key = ("warning", "harm") if harm else (None, None)
    return TFD313.verdict(evidence, severity=severity, key=key, step=change.to_step, beside=beside, **window)


# ---------------------------------------------------------------------------------------------------------- TFD314


def weight_decay_per_step(param_groups: Sequence[Mapping[str, Any]]) -> float:
    """The strongest decoupled decay per step, ``lr x weight_decay``, of ``param_groups`` (host floats; a tensor LR
    is read to the host)."""
    return max(
        (float(group["lr"]) * float(group.get("weight_decay", 0.0) or 0.0) for group in param_groups), default=0.0
    )


TFD314 = Rule(
    "TFD314",
    "warning",
    "UpdateRatio",
    title=(
        "the weights deflate (median group norm fell below 1/`growth_limit` in `growth_window` steps): decay far "
        "too strong"
    ),
    headline="the weights deflate: median group norm x{median_growth:.3g} in {steps} steps",
    chart=EvidenceChart("Do the weights shrink?", "L2 norm", logged=("update_ratio/param_norm/total",)),
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
    message=(
        "Weights are shrinking fast: the median group norm fell to {median_growth:.3g}x of its value in {steps} "
        "optimizer steps (limit 1/{growth_limit:g} in {growth_window}).{because}"
    ),
    details=(
        "When the median group's weight norm fell below `1 / growth_limit` (default 1/2) of its value within "
        "`growth_window` (default 50) optimizer steps, groups under 5% of the largest group's norm left out. The "
        "finding quotes the largest `lr * weight_decay` of the optimizer's groups and the half-life it implies. "
        "Measured (AdamW lr 2e-3, decay on every tensor, 150 steps): weight_decay 0.1 and 1.0 keep the median norm at"
        " 0.96x or more on every model tried; 10 takes it to 0.39x to 0.44x."
    ),
)


def weights_shrinking(
    change: NormChange | None, param_groups: Sequence[Mapping[str, Any]], *, growth_limit: float, growth_window: int
) -> Verdict | None:
    """TFD314: the median group norm fell below ``1 / growth_limit`` of its value within the window, quoting the
    strongest weight decay of ``param_groups`` (read only then)."""
    if change is None or change.median >= 1.0 / growth_limit:
        return None
    decay = weight_decay_per_step(param_groups)
    because = ""
    if decay > 0:
        because = (
            f" The strongest weight decay shrinks weights by lr x weight_decay = {decay:.3g} per step (half the "
            f"norm every {math.log(2) / decay:.0f} steps without gradients)."
        )
    evidence = {**change.evidence(largest_first=False), "lr_times_weight_decay": decay}
    window = {"steps": change.to_step - change.from_step, "growth_limit": growth_limit, "growth_window": growth_window}
    return TFD314.verdict(evidence, step=change.to_step, because=because, **window)


# ---------------------------------------------------------------------------------------------------------- together
def update_verdicts(
    reading: UpdateReading,
    memory: UpdateMemory,
    facts: GroupFacts,
    param_groups: Sequence[Mapping[str, Any]],
    *,
    low: float,
    high: float,
    patience: int,
    decayed_lr_fraction: float,
    growth_limit: float,
    growth_window: int,
    ln_vocab: float | None,
    planned_lr: float | None = None,
) -> list[Verdict | None]:
    """Every rule on one measured step, in order (TFD310, TFD311, TFD313, TFD314, TFD312), after ``memory`` took
    the reading in. ``param_groups``: every optimizer's param groups (read only when a rule needs them);
    ``planned_lr``: the highest LR the schedule reaches in this run (None: unknown)."""
    memory.observe(reading)
    stuck = stuck_groups(reading, memory.streak, patience=patience)
    left_out, rounded = left_out_or_rounded(stuck, reading, facts, param_groups)
    change = norm_change(
        memory.norms, reading.param_norms, reading.step, growth_window=growth_window, loss=reading.mean_loss
    )
    window = {"growth_limit": growth_limit, "growth_window": growth_window}
    harm = growth_harm(change, reading, high=high, growth_limit=growth_limit) if change is not None else None
    return [
        tiny_updates(
            reading,
            memory,
            rounded,
            low=low,
            high=high,
            patience=patience,
            decayed_lr_fraction=decayed_lr_fraction,
            ln_vocab=ln_vocab,
            planned_lr=planned_lr,
        ),
        huge_update(reading, low=low, high=high),
        weights_growing(change, reading, harm, **window),
        weights_shrinking(change, param_groups, **window),
        not_in_optimizer(left_out, reading, patience=patience),
    ]


BLOCK = ("TFD310", "TFD319")
"""The codes reserved for UpdateRatio's rules."""

RULES: tuple[Rule, ...] = (TFD310, TFD311, TFD312, TFD313, TFD314)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "update size": (
        "TFD310",
        "TFD311",
        "TFD312",
        "TFD313",
        "TFD314",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
