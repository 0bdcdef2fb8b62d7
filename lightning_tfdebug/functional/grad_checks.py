"""The rules GradNormMonitor decides: each finding code with its severity, text and hint."""

from __future__ import annotations

from lightning_tfdebug.functional.verdicts import Rule

TFD301 = Rule(
    "TFD301",
    "warning",
    "GradNormMonitor",
    title="explosion: total above `explosion_factor` x running median",
    trigger="total gradient norm above `explosion_factor` x its running median, after `warmup_measurements`",
    hint=(
        "Usual causes: learning rate too high or no warm-up, a bad batch, attention logits growing. Lower the LR,"
        " add warm-up, or clip gradients (Trainer(gradient_clip_val=1.0))."
    ),
    reason="Measured: a gradient far above this run's own history, the step that moves weights the most",
)

TFD302 = Rule(
    "TFD302",
    "warning",
    "GradNormMonitor",
    title="vanishing: groups far below the largest group, sustained",
    trigger=(
        "a group's norm below `vanishing_ratio` x the largest group norm for `patience` measurements in a row, "
        "among the groups an optimizer steps (a group in no optimizer's param groups is neither the reference nor "
        "judged: it never learns, and its gradient stays at its initial size)"
    ),
    hint=(
        "Those layers barely learn. Usual causes: missing residual connections, saturating activations "
        "(sigmoid/tanh), post-norm without warm-up, or a detach() in the forward."
    ),
    reason="Measured, sustained: a group whose gradient is far below the others' barely trains",
)

TFD303 = Rule(
    "TFD303",
    "error",
    "GradNormMonitor",
    title="non-finite gradients (without a GradScaler), naming the groups",
    trigger="a gradient holds inf/nan (without a GradScaler; with one, ScalerWatch owns overflow)",
    hint=(
        "Add NaNFirstFrame to find the first module that produced them; check the learning rate, the loss (log of"
        " zero, division by zero) and fp16 ranges."
    ),
    reason=(
        "A step with inf/nan gradients and no GradScaler to skip it writes NaN into the weights: the run cannot recover"
    ),
)

TFD304 = Rule(
    "TFD304",
    "warning",
    "GradNormMonitor",
    title="trainable parameters that never receive a gradient",
    trigger="a trainable parameter received no gradient in `patience` measured steps",
    hint=(
        "They are not used in the forward that produces the loss (dead branch, a detach, a module called outside "
        "forward). Freeze them (requires_grad=False) or fix the forward."
    ),
    reason=("Measured: trainable parameters that never get a gradient never train (a branch the loss does not reach)"),
)

TFD305 = Rule(
    "TFD305",
    "info",
    "GradNormMonitor",
    title="the optimizer unscales inside `step()`; the norm was divided by the loss scale",
    trigger=(
        "the optimizer unscales inside `step()` (fused AdamW under fp16): gradients were measured scaled and "
        "divided by the loss scale here"
    ),
    hint=("Nothing to fix. Note that Trainer-side clipping and any other hook reading .grad see scaled values."),
    reason="An observation about how the norm was measured; the training itself is unaffected",
)

TFD306 = Rule(
    "TFD306",
    "warning",
    "GradNormMonitor",
    title="norm clipping cuts every step by over 100x: `gradient_clip_val` far below the gradient norm",
    trigger=(
        "norm clipping on, every step since the last measurement clipped, and the gradient norm above 100 x "
        "`gradient_clip_val`, for `patience` measurements"
    ),
    hint=(
        "Set gradient_clip_val near the gradient norm of healthy steps (look at grad_norm/total; 1.0 is usual for"
        " transformers with a mean loss) so that it only cuts spikes. With SGD the step shrinks by that factor; "
        "with Adam the clipped gradients can fall below eps and the step shrinks too. A norm this far above any "
        "sane clip can also mean a summed loss (LossAtInit names it)."
    ),
    reason=(
        "Measured: clipping cuts every step by over 100x, which makes the learning rate set 100x too high in effect"
    ),
)

BLOCK = ("TFD301", "TFD309")
"""The codes reserved for GradNormMonitor's rules."""

RULES: tuple[Rule, ...] = (
    TFD301,
    TFD302,
    TFD303,
    TFD304,
    TFD305,
    TFD306,
)
"""The rules decided in this module, in code order."""
