"""ScalerWatch's rules ``TFD410``-``TFD414``, decided from a :class:`ScalerReading` read once per logging step."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict


@dataclass(frozen=True)
class ScalerReading:
    """The GradScaler's record at one logging step, on the host; every field but ``step`` is the evidence of a finding.

    Attributes:
        step: the step it was read at.
        scale: the loss scale after this step's ``update()``.
        skipped_steps: optimizer steps skipped for overflow since the start.
        steps: optimizer steps watched since the start.
        recent_steps: optimizer steps within the last ``window``.
        recent_skipped: of those, the skipped ones.
        recent_backoffs: times the scale was reduced within the last ``window`` steps.
        overflow_groups: the parameter groups whose gradients overflowed, the most often first.
    """

    step: int
    scale: float
    skipped_steps: int
    steps: int
    recent_steps: int
    recent_skipped: int
    recent_backoffs: int
    overflow_groups: tuple[str, ...] = ()

    def evidence(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "step"}
        return {**out, "overflow_groups": list(self.overflow_groups)}


TFD410 = Rule(
    "TFD410",
    "info",
    "ScalerWatch",
    title="no GradScaler (bf16 or 32-bit): nothing to watch",
    trigger="precision uses no GradScaler (bf16 or 32-bit): ScalerWatch has nothing to watch and stays idle",
    hint="Nothing to fix. Remove ScalerWatch, or keep it: it costs nothing without a scaler.",
    reason="An observation: without a GradScaler there is nothing for ScalerWatch to watch",
    message=(
        "ScalerWatch has nothing to watch: precision {precision!r} uses no GradScaler (only fp16 AMP does), so no "
        "step is ever skipped for overflow."
    ),
)


def no_scaler(precision: str) -> Verdict:
    """TFD410: the Trainer's ``precision`` uses no GradScaler (bf16, 32-bit): there is nothing to watch."""
    return TFD410.verdict({"precision": precision})


TFD411 = Rule(
    "TFD411",
    "error",
    "ScalerWatch",
    title="the loss scale collapsed (below `min_scale`, or halved repeatedly within `window`)",
    headline="the loss scale collapsed: {why}",
    chart=EvidenceChart("Did the loss scale collapse?", "loss scale", logged=("scaler/scale",), log_scale=True),
    trigger=(
        "the fp16 loss scale fell below `min_scale`, or was reduced `collapse_backoffs` times within the last "
        "`window` steps"
    ),
    hint=(
        "Something overflows fp16 on every step: add NaNFirstFrame to name the module, keep it in fp32 or switch "
        "to bf16; lower the LR or add warm-up if it started after a spike."
    ),
    reason="A collapsed loss scale underflows every gradient or skips every step: the run cannot train",
    message="The fp16 loss scale collapsed: it {why}. Gradients overflow on most steps{where}",
    details=(
        "Decided on logging steps (`global_step % every_n_steps == 0`) from counters kept on the device every "
        "optimizer step: when the loss scale is below `min_scale` (default 1.0), or the scaler reduced it "
        "`collapse_backoffs` (default 8) times or more within the last `window` (default 50) steps."
    ),
)


def scale_collapsed(reading: ScalerReading, *, min_scale: float, collapse_backoffs: int) -> Verdict | None:
    """TFD411: the scale fell below ``min_scale``, or was reduced ``collapse_backoffs`` times within the window."""
    if reading.scale < min_scale:
        why = f"fell to {reading.scale:.3g} (below min_scale={min_scale:g})"
    elif reading.recent_backoffs >= collapse_backoffs:
        why = f"was reduced {reading.recent_backoffs} times in the last {reading.recent_steps} steps"
    else:
        return None
    where = f" (overflowing groups: {', '.join(reading.overflow_groups)})." if reading.overflow_groups else "."
    return TFD411.verdict(reading.evidence(), step=reading.step, why=why, where=where)


TFD412 = Rule(
    "TFD412",
    "warning",
    "ScalerWatch",
    title="a high fraction of steps skipped; names the groups whose gradients overflowed",
    headline="{recent_skipped} of the last {recent_steps} steps skipped for overflow",
    chart=EvidenceChart(
        "How many steps were skipped for overflow?",
        "fraction of steps",
        logged=("scaler/skipped_frac",),
    ),
    trigger=(
        "more than `max_skipped_frac` of the last `window` optimizer steps were skipped for overflow; names the "
        "parameter groups whose gradients held inf/nan"
    ),
    hint=(
        "Skipped steps are lost updates. Find the overflowing module (NaNFirstFrame), keep it in fp32, use bf16, "
        "or lower GradScaler's init_scale if only the first steps skip."
    ),
    reason="Loses work: a large share of the steps was skipped for overflow",
    message="{recent_skipped} of the last {recent_steps} optimizer steps were skipped for fp16 overflow{where}",
    details=(
        "On a logging step, once at least `min_steps` (default 10) steps were watched, when more than "
        "`max_skipped_frac` (default 0.25) of the last `window` (default 50) optimizer steps were skipped for "
        "overflow. The groups named are those whose gradients held inf/nan on a skipped logging step (one fused norm "
        "per group, before the optimizer step)."
    ),
)


def many_skipped(reading: ScalerReading, *, min_steps: int, max_skipped_frac: float) -> Verdict | None:
    """TFD412: more than ``max_skipped_frac`` of the window's steps were skipped, once ``min_steps`` were watched."""
    if reading.steps < min_steps or not reading.recent_steps:
        return None
    if reading.recent_skipped / reading.recent_steps <= max_skipped_frac:
        return None
    where = f"; gradients overflowed in {', '.join(reading.overflow_groups)}." if reading.overflow_groups else "."
    return TFD412.verdict(reading.evidence(), step=reading.step, where=where)


def steps_on_skipped(advanced: int, steps: int, skipped: int) -> int:
    """How many of ``skipped`` optimizer steps (of ``steps``) a scheduler that stepped ``advanced`` times took: every
    scheduler step beyond the ``steps - skipped`` applied ones was taken on a skipped one (a skip-aware scheduler
    takes none)."""
    return max(0, min(skipped, advanced - (steps - skipped)))


TFD413 = Rule(
    "TFD413",
    "warning",
    "ScalerWatch",
    title="a per-step LR scheduler advanced on steps the optimizer skipped",
    headline="LR scheduler {scheduler} advanced on {scheduler_steps_on_skipped} skipped steps",
    trigger=(
        "a per-step LR scheduler advanced (its `last_epoch`) on `lr_skipped_steps` optimizer steps that the "
        "GradScaler skipped"
    ),
    hint=(
        "Fix the overflow that skips steps; or step the scheduler only when the scale did not drop (compare "
        "scaler.get_scale() before and after update())."
    ),
    reason="Measured: the schedule advanced on steps the optimizer skipped, so it runs ahead of the updates",
    message=(
        "A per-step LR scheduler ({scheduler}) advanced on {scheduler_steps_on_skipped} optimizer steps that the "
        "GradScaler skipped: the schedule (warm-up, decay) runs ahead of the updates actually applied."
    ),
    details=(
        "When a per-step LR scheduler's `last_epoch` moved on `lr_skipped_steps` (default 10) or more optimizer steps"
        " that the GradScaler skipped (it advanced more often than steps were applied). A scheduler stepped only on "
        "applied steps is not blamed."
    ),
)


def schedule_on_skipped(
    reading: ScalerReading, scheduler: str | None, on_skipped: int, *, lr_skipped_steps: int
) -> Verdict | None:
    """TFD413: a per-step LR scheduler (its class name; None: no per-step scheduler) advanced on ``on_skipped``
    skipped steps, ``lr_skipped_steps`` or more."""
    if scheduler is None or on_skipped < lr_skipped_steps:
        return None
    evidence = {**reading.evidence(), "scheduler": scheduler, "scheduler_steps_on_skipped": on_skipped}
    return TFD413.verdict(evidence, step=reading.step)


TFD414 = Rule(
    "TFD414",
    "warning",
    "ScalerWatch",
    title="the scale never grew for several growth intervals",
    headline="the loss scale never grew in {steps_without_growth} steps",
    chart=EvidenceChart("Does the loss scale grow?", "loss scale", logged=("scaler/scale",), log_scale=True),
    trigger="the loss scale did not grow for `no_growth_intervals` x `growth_interval` steps",
    hint=(
        "Overflows recur regularly: look for the module near the fp16 limit (NaNFirstFrame, eager mode) or switch"
        " to bf16."
    ),
    reason="Measured: the scale never grew, so overflow keeps skipping steps",
    message=(
        "The loss scale has not grown for {steps_without_growth} steps ({no_growth_intervals:g} x "
        "growth_interval={growth_interval}): overflow keeps interrupting every run of clean steps."
    ),
    details=(
        "When the scale did not grow for `no_growth_intervals` (default 3) times the scaler's `growth_interval` steps"
        " (2000 by default, so 6000 steps): overflow keeps interrupting every run of clean steps."
    ),
)


def scale_never_grew(
    reading: ScalerReading, *, last_growth: int, growth_events: int, growth_interval: int, no_growth_intervals: float
) -> Verdict | None:
    """TFD414: the scale did not grow for ``no_growth_intervals`` x the scaler's ``growth_interval`` steps since the
    step count ``last_growth`` at its last growth (``growth_events`` times in all)."""
    without = reading.steps - last_growth
    if without < no_growth_intervals * growth_interval:
        return None
    evidence = {**reading.evidence(), "growth_interval": growth_interval, "growth_events": growth_events}
    return TFD414.verdict(
        evidence, step=reading.step, steps_without_growth=without, no_growth_intervals=no_growth_intervals
    )


BLOCK = ("TFD410", "TFD419")
"""The codes reserved for ScalerWatch's rules."""

RULES: tuple[Rule, ...] = (TFD410, TFD411, TFD412, TFD413, TFD414)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "fp16 loss scale": (
        "TFD411",
        "TFD412",
        "TFD413",
        "TFD414",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
