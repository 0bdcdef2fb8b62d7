"""NaNFirstFrame's rules ``TFD401``-``TFD403``, decided from a :class:`NaNStep` that every rank holds alike (so every
rank reaches the same verdict). Host values only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_tfdebug.functional.frames import LOSS_FRAME
from lightning_tfdebug.functional.verdicts import Rule, Verdict

_FRAMES_HINT = (
    "Read the report's frames: the abs-max column shows where values grew; a small 'fp16 room' means the next "
    "operation may overflow. Under fp16 keep that module in fp32 (or use bf16), lower the LR, add warm-up or "
    "clipping; a nan from log(0), sqrt(0) backward or 0/0 points at the named module's math."
)
_LOSS_HINT = (
    "Every module's output was finite: look at the loss itself. A batch whose labels are all ignore_index gives mean "
    "cross-entropy 0/0 = nan (BatchGuard and LossAtInit name it); a hand-written loss taking log of a probability "
    "that reached 0 gives -inf (use log_softmax / cross_entropy on logits)."
)


@dataclass(frozen=True)
class NaNStep:
    """A bad step, as every rank knows it once the ranks shared their first frames.

    Attributes:
        step: the optimizer step.
        bad_ranks: the ranks whose loss (or, when no loss was, whose gradients) held inf/nan.
        frame_ranks: the ranks where a module output held inf/nan (eager mode).
        everyone: per rank, :func:`rank_frames`.
        report, report_json: this rank's report files.
        batch_idx, precision: where and how the step ran.
        error: the replay's error, if it failed.
        skipped: the optimizer step was not applied.
    """

    step: int
    bad_ranks: Sequence[int]
    frame_ranks: Sequence[int]
    everyone: Sequence[Mapping[str, Any]]
    report: str
    report_json: str
    batch_idx: int | None = None
    precision: str = ""
    error: str | None = None
    skipped: bool = False

    @classmethod
    def of(
        cls,
        summary: Mapping[str, Any],
        everyone: Sequence[Mapping[str, Any]],
        report: str,
        report_json: str,
        skipped: bool = False,
    ) -> NaNStep:
        """The reading of a rank's report ``summary`` (:func:`~lightning_tfdebug.functional.frames.nan_report`) and
        every rank's :func:`rank_frames`."""
        return cls(
            summary["step"],
            summary["nonfinite_ranks"],
            summary["frame_nonfinite_ranks"],
            everyone,
            report,
            report_json,
            batch_idx=summary["batch_idx"],
            precision=summary["precision"],
            error=summary["replay_error"],
            skipped=skipped,
        )


def rank_frames(rank: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """What a rank shares of its report ``summary``: ``{"rank", "forward", "backward", "reproduced"}``, its first
    non-finite forward and backward module (or None) and whether the replay reproduced the step's flags (None: lazy)."""
    return {
        "rank": rank,
        "forward": (summary["first_forward"] or {}).get("module"),
        "backward": (summary["first_backward"] or {}).get("module"),
        "reproduced": summary["replay_reproduced"],
    }


def _where(culprit: Mapping[str, Any] | None) -> str:
    """The finding's sentence on where the first inf/nan appeared, forward and backward."""
    forward = culprit["forward"] if culprit else None
    if forward == LOSS_FRAME:
        where = (
            f"no module output held inf/nan; the first non-finite value is the loss computed in training_step on "
            f"rank {culprit['rank']} (a mean over zero supervised tokens, or log(0) or 0/0 in the loss function)"
        )
    elif forward:
        where = f"the first module whose forward output held inf/nan was `{forward}` on rank {culprit['rank']}"
    else:
        where = "no module output held inf/nan in the replay"
    if forward and culprit.get("reproduced") is False:
        where += " (named from that step's own output sums: the replay did not reproduce the inf/nan)"
    if culprit and culprit["backward"]:
        where += f"; the first non-finite gradient reached the output of `{culprit['backward']}`"
    return where


TFD401 = Rule(
    "TFD401",
    "error",
    "NaNFirstFrame",
    title=(
        "the loss or gradients became non-finite; names the first module (forward and backward), the rank(s) and "
        "the report"
    ),
    headline=(
        "non-finite loss or gradients at step {bad_step}: first in `{module:s}` on rank {module_rank}",
        "non-finite loss or gradients at step {bad_step} on rank(s) {ranks}",
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
    message=(
        "The loss or gradients became non-finite at step {bad_step} on rank(s) {ranks}: {where}. {skipped}Report: "
        "{report}"
    ),
    details=(
        "Checked on every optimizer step, before `optimizer.step()`: the loss of each micro-batch (`torch.isfinite`) "
        "and, without a GradScaler and unless `check_gradients=False`, the gradients (one fused norm, summed in "
        "float32 so that fp16 gradients with a norm above 65504 do not count as overflow; any inf/nan in a gradient "
        "makes the sum non-finite). With a GradScaler, overflowing gradients are the scaler's (ScalerWatch) and only "
        "a non-finite loss triggers. Every rank takes the decision on the same step; the step is then not applied "
        "(every gradient set to None) and replayed with frame hooks."
    ),
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
    message=(
        "At step {bad_step} a module produced inf/nan that did not reach the loss, on rank(s) {ranks}: {where}."
        "{replay_failed} Report: {report}"
    ),
    details=(
        'Eager mode only (`mode="eager"`, the `full` preset): on a step whose loss and gradients stayed finite, a '
        "module's forward output held inf/nan (read from the per-module output sums recorded on every step). The step"
        " is applied."
    ),
)


TFD403 = Rule(
    "TFD403",
    "error",
    "NaNFirstFrame",
    title="the loss or gradients became non-finite and replaying the step to locate the frame failed",
    headline="non-finite at step {bad_step} on rank(s) {ranks}; the replay to locate it failed",
    trigger=(
        "the loss or gradients became non-finite and replaying the step to locate the first bad frame raised; the"
        " report holds the error"
    ),
    hint="Run with mode='eager' to record frames during the step itself.",
    reason="The run produced a non-finite loss or gradient; only its location is missing",
    message=(
        "The loss or gradients became non-finite at step {bad_step} on rank(s) {ranks}, and replaying the batch to "
        "locate the first bad frame failed{on_rank}: {error}. Report: {report}"
    ),
)


def nonfinite_step(reading: NaNStep) -> Verdict | None:
    """TFD401 (a non-finite loss or gradients, located), TFD403 (the same, the replay failed) or TFD402 (eager mode: a
    module output held inf/nan that reached neither); None when nothing was non-finite (a float32 sum overflow)."""
    everyone = [r for r in reading.everyone if r]
    bad_ranks, frame_ranks = list(reading.bad_ranks), list(reading.frame_ranks)
    if not bad_ranks and not any(r["forward"] for r in everyone):
        return None
    named = [r for r in everyone if r["forward"]] or [r for r in everyone if r["backward"]]
    culprit = named[0] if named else None
    if not bad_ranks:  # eager mode: the ranks whose flagged outputs held inf/nan (not a float32 sum overflow)
        frame_ranks = [r for r in frame_ranks if any(e["rank"] == r and e["forward"] for e in everyone)]
    evidence = {
        "module": culprit["forward"] if culprit else None,
        "backward_module": culprit["backward"] if culprit else None,
        "module_rank": culprit["rank"] if culprit else None,
        "ranks": bad_ranks or frame_ranks,
        "per_rank": {str(r["rank"]): {"forward": r["forward"], "backward": r["backward"]} for r in everyone},
        "batch_idx": reading.batch_idx,
        "precision": reading.precision,
        "report": reading.report,
        "report_json": reading.report_json,
    }
    if culprit and culprit["forward"] and culprit.get("reproduced") is False:
        evidence["replay_reproduced"] = False
    key, error = f"step{reading.step}", reading.error
    if error and bad_ranks:
        return TFD403.verdict(evidence, key=key, bad_step=reading.step, on_rank="", error=error)
    where = _where(culprit)
    if bad_ranks:
        hint = _LOSS_HINT if culprit and culprit["forward"] == LOSS_FRAME else _FRAMES_HINT
        skipped = "The optimizer step was not applied. " if reading.skipped else ""
        return TFD401.verdict(evidence, hint=hint, key=key, bad_step=reading.step, where=where, skipped=skipped)
    replay_failed = f" The replay failed: {error}." if error else ""
    return TFD402.verdict(evidence, key=key, bad_step=reading.step, where=where, replay_failed=replay_failed)


def replay_failed_on_rank(step: int, bad_ranks: Sequence[int], rank: int, error: str, report: str) -> Verdict:
    """TFD403 from one rank alone: its FSDP2 replay failed part-way, so the ranks can share nothing more."""
    evidence = {"ranks": list(bad_ranks), "report": report, "replay_error": error}
    return TFD403.verdict(evidence, key=f"step{step}", bad_step=step, on_rank=f" on rank {rank}", error=error)


BLOCK = ("TFD401", "TFD409")
"""The codes reserved for NaNFirstFrame's rules."""

RULES: tuple[Rule, ...] = (TFD401, TFD402, TFD403)
"""The rules decided in this module, in code order."""


COVERAGE: dict[str, tuple[str, ...]] = {
    "non-finite values": (
        "TFD401",
        "TFD402",
        "TFD403",
    ),
}
"""The rows of the run's Coverage table these rules answer: the check -> the codes that decide it."""
