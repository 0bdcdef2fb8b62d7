"""GradNormMonitor's decisions: exploding, vanishing, non-finite, missing, still-scaled and over-clipped gradients.

One :class:`GradReading` per measuring step (host numbers) and the :class:`GradMemory` of earlier ones go to
:func:`grad_verdicts`; each rule is a function of host numbers that returns its verdict or None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.tracking import RunningWindow, Streak

OVERCLIP = 30.0
"""TFD306 when clipping keeps less than ``1 / OVERCLIP`` of the gradient's norm on every measured step."""


@dataclass(frozen=True)
class Clipping:
    """What clipping did on one measured step, read where Lightning applies it (both algorithms).

    Attributes:
        step: the optimizer step whose gradients were clipped.
        clip_val: ``gradient_clip_val`` of that clipping.
        algorithm: ``"norm"`` or ``"value"``.
        kept: the norm of the clipped gradient over the norm before clipping (1.0: nothing was cut).
    """

    step: int
    clip_val: float
    algorithm: str
    kept: float

    @classmethod
    def from_squares(cls, step: int, clip_val: float, algorithm: str, before: float, after: float) -> Clipping:
        """The clipping of gradients whose summed squared norm went from ``before`` to ``after``."""
        return cls(step, clip_val, algorithm, math.sqrt(after / before) if before > 0 else 1.0)


@dataclass(frozen=True)
class GradReading:
    """One measuring step's gradients, on the host.

    Attributes:
        total: the L2 norm over all gradients (unscaled; before clipping under automatic optimization).
        groups: each group's L2 norm, in the layout's order.
        nonfinite: per group, the number of parameter tensors whose gradient holds inf or nan.
        clipping: the latest measured clipping not read before (None: none).
    """

    total: float
    groups: dict[str, float]
    nonfinite: dict[str, float]
    clipping: Clipping | None = None

    @classmethod
    def from_squares(
        cls,
        names: Sequence[str],
        squares: Sequence[float],
        nonfinite: Sequence[float],
        clipping: Clipping | None = None,
    ) -> GradReading:
        """The reading of the per-group sums of squared norms and non-finite counts (host floats)."""
        return cls(
            total=math.sqrt(sum(squares)),
            groups={name: math.sqrt(sq) for name, sq in zip(names, squares)},
            nonfinite=dict(zip(names, nonfinite)),
            clipping=clipping,
        )

    @property
    def nonfinite_tensors(self) -> float:
        return float(sum(self.nonfinite.values()))

    def scalars(self, log_groups: bool = True) -> dict[str, float]:
        """The logged keys of this step (``GradNormMonitor.KEYS``); without ``log_groups``, no per-group key."""
        out = {"grad_norm/total": self.total}
        if log_groups:
            out.update({f"grad_norm/{name}": norm for name, norm in self.groups.items()})
        out["grad_norm/nonfinite"] = self.nonfinite_tensors
        return out


@dataclass
class GradMemory:
    """What the rules remember between measurements (saved in checkpoints).

    Attributes:
        history: the recent finite totals, whose median TFD301 compares against.
        vanishing: per group, the measurements in a row below the vanishing line (TFD302).
        no_grad: per parameter, the measurements in a row without a gradient (TFD304).
        overclip: the measurements in a row clipped to under ``1 / OVERCLIP`` (TFD306).
    """

    history: RunningWindow
    vanishing: Streak = field(default_factory=Streak)
    no_grad: Streak = field(default_factory=Streak)
    overclip: Streak = field(default_factory=Streak)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name).state_dict() for name in ("history", "vanishing", "no_grad", "overclip")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in ("history", "vanishing", "no_grad", "overclip"):
            getattr(self, name).load_state_dict(state.get(name, {}))


def _names(items: Sequence[str]) -> str:
    return ", ".join(items)


# ---------------------------------------------------------------------------------------------------------- TFD301
TFD301 = Rule(
    "TFD301",
    "warning",
    "GradNormMonitor",
    title="explosion: total above `explosion_factor` x running median",
    headline="gradient norm explosion: {grad_norm:.4g}, {factor:.1f}x the running median {running_median:.4g}",
    chart=EvidenceChart(
        "Did the gradient norm leave its running median?",
        "L2 norm",
        logged=("grad_norm/total",),
        lines=("running_median",),
        window=50,
        log_scale=True,
    ),
    trigger="total gradient norm above `explosion_factor` x its running median, after `warmup_measurements`",
    hint=(
        "Usual causes: learning rate too high or no warm-up, a bad batch, attention logits growing. Lower the LR,"
        " add warm-up, or clip gradients (Trainer(gradient_clip_val=1.0))."
    ),
    reason="Measured: a gradient far above this run's own history, the step that moves weights the most",
    message="The gradient norm exploded to {grad_norm:.4g}, {factor:.1f}x its running median of {running_median:.4g}.",
    details=(
        "On a measuring step, after `warmup_measurements` measurements (default 5), when the total gradient norm "
        "(after AMP unscaling, before clipping) exceeds `explosion_factor` (default 10) times the median of the last "
        "`history` (default 50) measured totals."
    ),
)


def explosion(total: float, history: RunningWindow, *, factor: float, warmup: int) -> Verdict | None:
    """TFD301 when the finite ``total`` is above ``factor`` x the median of ``history`` (once ``history`` holds
    ``warmup`` values); ``total`` then joins ``history``."""
    median = history.median()
    verdict = None
    if len(history) >= warmup and total > factor * median > 0:
        verdict = TFD301.verdict({"grad_norm": total, "running_median": median, "factor": total / median})
    history.add(total)
    return verdict


# ---------------------------------------------------------------------------------------------------------- TFD302
TFD302 = Rule(
    "TFD302",
    "warning",
    "GradNormMonitor",
    title="vanishing: groups far below the largest group, sustained",
    headline="vanishing gradients: {names} below {ratio:g}x of `{largest_group}`",
    chart=EvidenceChart(
        "Which blocks' gradients fell far below the largest?",
        "L2 norm",
        logged=("grad_norm/<group>",),
        log_scale=True,
    ),
    trigger=(
        "a group's norm below `vanishing_ratio` x the largest group norm for `patience` measurements in a row, "
        "among the groups an optimizer steps (a group in no optimizer's param groups is neither the reference nor "
        "judged: it never learns, and its gradient stays at its initial size); a group holding a tied parameter "
        "(embeddings shared with the output head) is judged but is no reference while an untied group is there"
    ),
    hint=(
        "Those layers barely learn. Usual causes: missing residual connections, saturating activations "
        "(sigmoid/tanh), post-norm without warm-up, or a detach() in the forward."
    ),
    reason="Measured, sustained: a group whose gradient is far below the others' barely trains",
    message=(
        "Gradients vanish in {names}: below {ratio:g} x the largest group norm ({largest_group}) for {patience} "
        "measurements in a row."
    ),
    details=(
        "When a group's norm stays below `vanishing_ratio` (default 1e-3) times the largest group norm for `patience`"
        " (default 3) measurements in a row. The reference is the largest group, not the median: when half of a deep "
        "stack stops learning the median group is itself vanishing, and the comparison would miss the case it is for."
        " A group holding a tied parameter (input embeddings shared with the LM head, as in GPT-2, T5 and BART) is "
        "judged but is not the reference while an untied group is there: it carries the output head's gradient, the "
        "largest of any LM (on a healthy BART the first encoder layer sits at about 3e-4 of the tied embeddings' "
        "norm, and at 1e-3 to 6e-2 of the largest untied group, while it trains). Only groups that an optimizer steps"
        " take part, as the reference and as candidates: a group left out of every optimizer keeps its initial "
        "gradient size while the trained groups' gradients fall, and is OptimizerAudit's TFD320 and UpdateRatio's "
        "TFD312. Which groups an optimizer holds is read once per fit, by identity; where an optimizer holds copies "
        "or flattened views (FSDP1 without `use_orig_params`) all groups take part."
    ),
)


def vanishing(
    norms: Mapping[str, float], streak: Streak, *, ratio: float, patience: int, tied: Sequence[str] = ()
) -> Verdict | None:
    """TFD302: the groups of ``norms`` (only those an optimizer steps) below ``ratio`` x the largest of them for
    ``patience`` measurements in a row. The reference is the largest group, not the median, which sinks with the
    groups it should expose when half of a deep stack vanishes. A ``tied`` group (input embeddings shared with the
    output head, which carry the head's gradient) is judged but is no reference while an untied group is there."""
    untied = [n for g, n in norms.items() if g not in tied]
    reference = max(untied or norms.values(), default=0.0)
    if len(norms) < 2 or reference <= 0:
        return None
    below = [g for g, n in norms.items() if streak.update(g, n < ratio * reference) >= patience]
    if not below:
        return None
    largest = next(g for g, n in norms.items() if n == reference and (g not in tied or not untied))
    evidence = {
        "groups": below,
        "group_norms": {g: norms[g] for g in below},
        "largest_group": largest,
        "largest_group_norm": reference,
    }
    return TFD302.verdict(evidence, names=_names(below), ratio=ratio, patience=patience)


# ---------------------------------------------------------------------------------------------------------- TFD303
TFD303 = Rule(
    "TFD303",
    "error",
    "GradNormMonitor",
    title="non-finite gradients (without a GradScaler), naming the groups",
    headline="non-finite gradients in {count} tensors: {names}",
    chart=EvidenceChart("When did the gradients turn non-finite?", "tensors", logged=("grad_norm/nonfinite",)),
    trigger="a gradient holds inf/nan (without a GradScaler; with one, ScalerWatch owns overflow)",
    hint=(
        "Add NaNFirstFrame to find the first module that produced them; check the learning rate, the loss (log of"
        " zero, division by zero) and fp16 ranges."
    ),
    reason=(
        "A step with inf/nan gradients and no GradScaler to skip it writes NaN into the weights: the run cannot recover"
    ),
    message="{count} parameter tensor(s) have inf/nan gradients, in groups {names}.",
    details=(
        "On a measuring step, when any parameter's gradient holds inf or nan and no GradScaler is in use (under a "
        "scaler, overflow is ScalerWatch's). The evidence names the groups with non-finite gradients."
    ),
)


def nonfinite_gradients(reading: GradReading, *, has_scaler: bool) -> Verdict | None:
    """TFD303 when a gradient holds inf/nan and no GradScaler is there to skip the step (under a GradScaler an
    overflowing step is skipped by design; ScalerWatch owns that diagnosis)."""
    groups = [g for g, n in reading.nonfinite.items() if n > 0]
    if not groups or has_scaler:
        return None
    count = reading.nonfinite_tensors
    return TFD303.verdict({"nonfinite_tensors": count, "groups": groups}, count=int(count), names=_names(groups))


# ---------------------------------------------------------------------------------------------------------- TFD304
TFD304 = Rule(
    "TFD304",
    "warning",
    "GradNormMonitor",
    title="trainable parameters that never receive a gradient",
    headline="{count} trainable parameters never receive a gradient: {names}",
    trigger="a trainable parameter received no gradient in `patience` measured steps",
    hint=(
        "They are not used in the forward that produces the loss (dead branch, a detach, a module called outside "
        "forward). Freeze them (requires_grad=False) or fix the forward."
    ),
    reason=("Measured: trainable parameters that never get a gradient never train (a branch the loss does not reach)"),
    message=(
        "{count} of {n_params} trainable parameter tensor(s) never received a gradient in {patience} measured steps: "
        "{names}{more}."
    ),
    details=(
        "When a trainable parameter (requires_grad) has had no gradient (`.grad is None`) on `patience` (default 3) "
        "measured steps."
    ),
)


def unused_parameters(
    missing: Sequence[str], present: Sequence[str], streak: Streak, *, patience: int
) -> Verdict | None:
    """TFD304: the parameters of ``missing`` (no gradient this measurement) that had none for ``patience``
    measurements in a row; a parameter of ``present`` starts its count again."""
    unused = [n for n in missing if streak.update(n, True) >= patience]
    for n in present:
        streak.counts.pop(n, None)
    if not unused:
        return None
    more = " ..." if len(unused) > 10 else ""
    evidence = {"parameters": unused[:50], "count": len(unused)}
    return TFD304.verdict(
        evidence, n_params=len(missing) + len(present), patience=patience, names=_names(unused[:10]), more=more
    )


# ---------------------------------------------------------------------------------------------------------- TFD305
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
    message=(
        "The optimizer ({optimizer}) unscales gradients inside step(), so they were still multiplied by the AMP loss "
        "scale when measured; GradNormMonitor divided them by the scale."
    ),
)


def still_scaled(optimizer: str, loss_scale: float | None) -> Verdict | None:
    """TFD305 when the gradients were measured still multiplied by ``loss_scale`` (None: they were unscaled before
    the hook), because the ``optimizer`` (its class name) unscales inside ``step()``."""
    if loss_scale is None:
        return None
    return TFD305.verdict({"loss_scale": loss_scale}, optimizer=optimizer)


# ---------------------------------------------------------------------------------------------------------- TFD306
TFD306 = Rule(
    "TFD306",
    "warning",
    "GradNormMonitor",
    title="clipping cuts every step to a small fraction of the gradient: `gradient_clip_val` far too small",
    headline="clipping keeps {kept:.2%} of the gradient (gradient_clip_val={gradient_clip_val:g})",
    chart=EvidenceChart(
        "How much of the gradient does clipping keep?",
        "fraction kept",
        logged=("grad_norm/clip_kept",),
    ),
    trigger=(
        "clipping (by norm or by value, automatic or manual optimization) kept less than 1/30 of the gradient's "
        "norm on `patience` measured steps in a row"
    ),
    hint=(
        "Set gradient_clip_val so that clipping only cuts spikes: for norm clipping near the gradient norm of healthy "
        "steps (grad_norm/total; 1.0 is usual for transformers with a mean loss), for value clipping above the size "
        "of ordinary gradient elements (clipping by norm is the usual choice). With SGD the step shrinks by the "
        "whole factor; with Adam the clipped gradients can fall below eps. A gradient this far above any sane "
        "clip can also mean a summed loss (LossAtInit names it)."
    ),
    reason=(
        "Measured: clipping cuts every step to a small fraction of the gradient, which makes the learning rate "
        "that much lower in effect"
    ),
    message=(
        "Clipping keeps only {kept:.2%} of the gradient's norm (a cut of {factor:.3g}x) with "
        'gradient_clip_val={gradient_clip_val:g} and gradient_clip_algorithm="{gradient_clip_algorithm}", on '
        "{patience} measured steps in a row: the clip value, not the gradient, sets the update's size."
    ),
    details=(
        "When clipping (by norm or by value; Trainer's `gradient_clip_val` or a manual `self.clip_gradients(...)`) "
        "keeps less than 1/30 of the gradient's norm (`grad_norm/clip_kept` below 0.033) on `patience` (default 3) "
        "measured steps in a row. Measured (bug matrix row 37: SGD with momentum 0.9 at lr 0.1, "
        "`gradient_clip_val=1e-4`, by value): clipping keeps 1.3% of the gradient on an `nn.TransformerEncoder` LM, "
        "0.8-1.2% on GPT-2 and 0.9-2.2% on T5, and the loss crawls (5.92 to 5.27 in 80 steps against 0.03 without the"
        " clip). Clipping at 1.0 while early norms sit at a few units keeps a third or more, far from the line."
    ),
)


def overclipping(clipping: Clipping | None, streak: Streak, *, patience: int) -> Verdict | None:
    """TFD306: clipping kept under ``1 / OVERCLIP`` of the gradient's norm on ``patience`` measurements in a row
    (a measurement without a clipping reading breaks the run)."""
    over = clipping is not None and clipping.kept < 1.0 / OVERCLIP
    if streak.update("total", over) < patience or clipping is None:
        return None
    evidence = {
        "gradient_clip_val": clipping.clip_val,
        "gradient_clip_algorithm": clipping.algorithm,
        "kept": clipping.kept,
        "factor": 1.0 / clipping.kept if clipping.kept > 0 else math.inf,
        "clipped_step": clipping.step,
    }
    return TFD306.verdict(evidence, patience=patience)


# ---------------------------------------------------------------------------------------------------------- together
def grad_verdicts(
    reading: GradReading,
    memory: GradMemory,
    *,
    trained: Sequence[str],
    has_scaler: bool,
    explosion_factor: float,
    warmup: int,
    vanishing_ratio: float,
    patience: int,
    tied: Sequence[str] = (),
) -> list[Verdict | None]:
    """The norm rules of one measurement, in order: non-finite gradients (TFD303) end the diagnosis; a non-finite
    total (an overflow a GradScaler skips) is not judged; otherwise explosion (TFD301) and vanishing (TFD302) among the
    ``trained`` groups (those an optimizer steps; ``tied``: those holding a shared parameter, see :func:`vanishing`)."""
    nonfinite = nonfinite_gradients(reading, has_scaler=has_scaler)
    if nonfinite is not None:
        return [nonfinite]
    if not math.isfinite(reading.total):
        return []
    norms = {g: reading.groups[g] for g in trained}
    return [
        explosion(reading.total, memory.history, factor=explosion_factor, warmup=warmup),
        vanishing(norms, memory.vanishing, ratio=vanishing_ratio, patience=patience, tied=tied),
    ]


BLOCK = ("TFD301", "TFD309")
"""The codes reserved for GradNormMonitor's rules."""

RULES: tuple[Rule, ...] = (TFD301, TFD302, TFD303, TFD304, TFD305, TFD306)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "gradient norms": (
        "TFD301",
        "TFD302",
        "TFD303",
        "TFD304",
        "TFD305",
        "TFD306",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
