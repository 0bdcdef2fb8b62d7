"""The rules NaNFirstFrame decides: each finding code with its severity, text and hint."""

from __future__ import annotations

from lightning_tfdebug.functional.verdicts import Rule

TFD401 = Rule(
    "TFD401",
    "error",
    "NaNFirstFrame",
    title=(
        "the loss or gradients became non-finite; names the first module (forward and backward), the rank(s) and "
        "the report"
    ),
    trigger=(
        "the loss of a micro-batch or (without a GradScaler) a gradient became inf/nan; the step is not applied "
        "and replayed with frame hooks (in eager mode the first non-finite output is also named from this "
        "step's own per-module output sums, even when the replay does not reproduce); names the first module "
        "whose forward output and whose output gradient held inf/nan, the rank(s), and the report "
        "`<log_dir>/tfdebug/nan-step<k>-rank<r>.txt`"
    ),
    hint=(
        "read the report's frames: abs-max growing toward the fp16 limit (small `fp16 room`) means overflow; keep"
        " that module in fp32 or use bf16, lower the LR, add warm-up or clipping; a nan with finite inputs points"
        " at the module's math (`log(0)`, `sqrt` of 0 in backward, 0/0)"
    ),
    reason="A non-finite loss or gradient destroys the weights at the step it reaches: the run cannot continue",
)

TFD402 = Rule(
    "TFD402",
    "info",
    "NaNFirstFrame",
    title="eager mode: a module produced inf/nan that did not reach the loss",
    trigger=(
        "eager mode: a module output held inf/nan although the loss and gradients stayed finite (a fully masked "
        "softmax row, `log(0)` at padding, a discarded branch)"
    ),
    hint=(
        "Masked or discarded positions still hold inf/nan (e.g. a softmax over a fully masked row, log(0) at "
        "padding). Harmless until a mask or branch changes; fix the math at the named module."
    ),
    reason=(
        "Inf/nan inside the forward that reached neither the loss nor the gradients did no measurable harm (a fully"
        " masked row, a discarded branch)"
    ),
)

TFD403 = Rule(
    "TFD403",
    "error",
    "NaNFirstFrame",
    title="the loss or gradients became non-finite and replaying the step to locate the frame failed",
    trigger=(
        "the loss or gradients became non-finite and replaying the step to locate the first bad frame raised; the"
        " report holds the error"
    ),
    hint="Run with mode='eager' to record frames during the step itself.",
    reason="The run produced a non-finite loss or gradient; only its location is missing",
)

BLOCK = ("TFD401", "TFD409")
"""The codes reserved for NaNFirstFrame's rules."""

RULES: tuple[Rule, ...] = (
    TFD401,
    TFD402,
    TFD403,
)
"""The rules decided in this module, in code order."""
