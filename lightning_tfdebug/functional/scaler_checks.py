"""The rules ScalerWatch decides: each finding code with its severity, text and hint."""

from __future__ import annotations

from lightning_tfdebug.functional.verdicts import Rule

TFD410 = Rule(
    "TFD410",
    "info",
    "ScalerWatch",
    title="no GradScaler (bf16 or 32-bit): nothing to watch",
    trigger="precision uses no GradScaler (bf16 or 32-bit): ScalerWatch has nothing to watch and stays idle",
    hint="Nothing to fix. Remove ScalerWatch, or keep it: it costs nothing without a scaler.",
    reason="An observation: without a GradScaler there is nothing for ScalerWatch to watch",
)

TFD411 = Rule(
    "TFD411",
    "error",
    "ScalerWatch",
    title="the loss scale collapsed (below `min_scale`, or halved repeatedly within `window`)",
    trigger=(
        "the fp16 loss scale fell below `min_scale`, or was reduced `collapse_backoffs` times within the last "
        "`window` steps"
    ),
    hint=(
        "Something overflows fp16 on every step: add NaNFirstFrame to name the module, keep it in fp32 or switch "
        "to bf16; lower the LR or add warm-up if it started after a spike."
    ),
    reason="A collapsed loss scale underflows every gradient or skips every step: the run cannot train",
)

TFD412 = Rule(
    "TFD412",
    "warning",
    "ScalerWatch",
    title="a high fraction of steps skipped; names the groups whose gradients overflowed",
    trigger=(
        "more than `max_skipped_frac` of the last `window` optimizer steps were skipped for overflow; names the "
        "parameter groups whose gradients held inf/nan"
    ),
    hint=(
        "Skipped steps are lost updates. Find the overflowing module (NaNFirstFrame), keep it in fp32, use bf16, "
        "or lower GradScaler's init_scale if only the first steps skip."
    ),
    reason="Loses work: a large share of the steps was skipped for overflow",
)

TFD413 = Rule(
    "TFD413",
    "warning",
    "ScalerWatch",
    title="a per-step LR scheduler advanced on steps the optimizer skipped",
    trigger=(
        "a per-step LR scheduler advanced (its `last_epoch`) on `lr_skipped_steps` optimizer steps that the "
        "GradScaler skipped"
    ),
    hint=(
        "Fix the overflow that skips steps; or step the scheduler only when the scale did not drop (compare "
        "scaler.get_scale() before and after update())."
    ),
    reason="Measured: the schedule advanced on steps the optimizer skipped, so it runs ahead of the updates",
)

TFD414 = Rule(
    "TFD414",
    "warning",
    "ScalerWatch",
    title="the scale never grew for several growth intervals",
    trigger="the loss scale did not grow for `no_growth_intervals` x `growth_interval` steps",
    hint=(
        "Overflows recur regularly: look for the module near the fp16 limit (NaNFirstFrame, eager mode) or switch"
        " to bf16."
    ),
    reason="Measured: the scale never grew, so overflow keeps skipping steps",
)

BLOCK = ("TFD410", "TFD419")
"""The codes reserved for ScalerWatch's rules."""

RULES: tuple[Rule, ...] = (
    TFD410,
    TFD411,
    TFD412,
    TFD413,
    TFD414,
)
"""The rules decided in this module, in code order."""
