"""MaskProbe's rules on the targets: labels shifted not at all or twice (``TFD205``, ``TFD206``, ``TFD210``), a
model that cannot be called (``TFD211``) and an encoder's objective (``TFD212``; the kind measured in
:mod:`.kind_checks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.probes import classify_alignment
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key

if TYPE_CHECKING:
    from lightning_tfdebug.primitives.calls import Objective
from lightning_tfdebug.callbacks.mask_probe.readings import (
    LOSS_RETURNED,
    LOSS_SHIFTED,
    LOSS_SHIFTED2,
    LOSS_UNSHIFTED,
    Number,
    Reading,
)

# -------------------------------------------------------------------------------------------------- target alignment
TFD205 = Rule(
    "TFD205",
    "error",
    "MaskProbe",
    title="labels not shifted: position t is trained on token t (the model learns to copy its input)",
    headline=(
        "labels not shifted: loss {loss_returned:.4g} = unshifted {loss_unshifted:.4g}, not shifted {loss_shifted:.4g}"
    ),
    chart=EvidenceChart(
        "Which labelling does the returned loss match?",
        "nats",
        bars=("loss_returned", "loss_unshifted", "loss_shifted"),
    ),
    trigger=(
        "the loss `training_step` returned equals the cross-entropy of position t against token t (labels equal "
        "to the inputs, no shift)"
    ),
    details=(
        "On a probing step with `check_targets` (default true, automatic optimization), for a decoder: the loss "
        "`training_step` returned (undone of gradient accumulation and an fp16 loss scale) is compared with the "
        "cross-entropy of the same logits against the labels at t+1, t and t+2. Fires when the labels equal the "
        "inputs and the returned loss matches the t-alignment only, within `rtol * max(1, |loss|)` (`rtol` 2e-5 for "
        "fp32 logits, 1e-3 for half precision, at least 4 eps of the loss's dtype), while every other alignment is "
        "more than 4x that away. When the alignments are closer than that the check retries at steps 1, 5, 20, 50, "
        "100, 200 and 500."
    ),
    hint="Shift in the loss (`logits[:, :-1]` against `labels[:, 1:]`) or in the data, exactly once.",
    reason="Position t scored against token t teaches the model to copy its input: the run cannot learn the task",
    message=(
        "Labels are not shifted: the loss training_step returned ({loss_returned:.6g}) is the loss of position t "
        "against token t ({loss_unshifted:.6g}), not against token t+1 ({loss_shifted:.6g}). A causal model trained "
        "this way learns to copy its input."
    ),
)


TFD206 = Rule(
    "TFD206",
    "error",
    "MaskProbe",
    title="labels shifted twice: position t is trained on token t+2",
    headline=(
        "labels shifted twice: loss {loss_returned:.4g} = two ahead {two_ahead:.4g}, not one ahead {one_ahead:.4g}"
    ),
    chart=EvidenceChart(
        "Which labelling does the returned loss match?",
        "nats",
        bars=("loss_returned", "loss_unshifted", "loss_shifted", "loss_shifted2"),
    ),
    trigger=(
        "position t trained on token t+2: labels shifted in the data and again by the loss, or equal to the inputs "
        "and shifted twice by `training_step` (by hand, then inside a Hugging Face model)"
    ),
    details=(
        "As `TFD205` (same losses, tolerance and retry steps), when the loss matches position t against token t+2: "
        "labels equal to the inputs and the returned loss matching the t+2 alignment, or labels already shifted in "
        "the data (`labels[t] == input_ids[t+1]` at every supervised position) and the returned loss matching the t+1"
        " alignment against them."
    ),
    hint=(
        "Shift exactly once: in the data collator or in the loss, not both. Hugging Face causal LMs shift "
        "`labels` inside the model: pass labels equal to input_ids (padding as -100)."
    ),
    reason=(
        "Position t scored against token t+2 trains a different task than next-token prediction: the run cannot "
        "succeed as configured"
    ),
    message=(
        "Labels are shifted twice: {where}, so position t is trained on token t+2 (returned {loss_returned:.6g}, two "
        "tokens ahead {two_ahead:.6g}, next token {one_ahead:.6g})."
    ),
)


TFD210 = Rule(
    "TFD210",
    "info",
    "MaskProbe",
    title=(
        "target alignment undetermined (loss matches neither alignment, or `training_step` could not be replayed); "
        "warning: a measured causal LM's labels are neither its inputs nor its next inputs"
    ),
    headline="labels misaligned on a causal LM: {misaligned}",
    trigger=(
        "the returned loss matches neither alignment (label smoothing, auxiliary losses), or `training_step` "
        "could not be replayed; at warning, a model measured causal with outputs over the input vocabulary whose "
        "labels are neither its inputs nor its next inputs"
    ),
    details=(
        "Info, as `TFD205`: the t and t+1 alignments' losses differ by more than 4 `rtol * max(1, |loss|)` (or the "
        "last retry step, 500, is reached) and the returned loss matches no alignment, or matches one that cannot be "
        "told from another; or the alignment cannot be checked on this run (the step's loss or logits could not be "
        "read). Warning, at the first probe with `causal=None` when the labels equal the inputs at less than half of "
        "the supervised positions and the next inputs at less than half of those with a next input: the kind is "
        "measured (the tokens after the middle of the probe rows replaced leave the outputs at and before it within "
        "fp32's tolerance, 1e-4 of the largest |logit|, in every dtype, and two passes of the same tokens agree), the "
        "outputs are over the input vocabulary (wider than every id and label, and than the token embedding's rows) "
        "and the message names the relation "
        "measured: the labels against the inputs and the next inputs of the sample itself and of its neighbours "
        "along the batch (rows rolled by one either way), named when it holds at half of the positions or more."
    ),
    hint="nothing if expected; otherwise check `labels_key` / `ignore_index`",
    reason=(
        "An observation when the alignment could not be decided from the loss; a measured misalignment (warning) "
        "trains the causal LM on tokens it cannot predict"
    ),
    message=("Target alignment {state}: {detail}."),
)


@dataclass(frozen=True)
class AlignmentReading(Reading):
    """The loss ``training_step`` returned against the cross-entropy of its logits under three alignments."""

    returned: Number
    shifted: Number
    unshifted: Number
    shifted2: Number
    relation: str
    rtol: float
    last_try: bool
    LOGGED: ClassVar[Mapping[str, Key]] = {
        "returned": LOSS_RETURNED,
        "shifted": LOSS_SHIFTED,
        "unshifted": LOSS_UNSHIFTED,
        "shifted2": LOSS_SHIFTED2,
    }


def decide_alignment(r: AlignmentReading) -> tuple[bool, Verdict | None]:
    """``(decided, verdict)`` of the target alignment (``TFD205``, ``TFD206``, ``TFD210``); undecided while the
    alignments' losses are too close to tell apart."""
    alignment, matched = classify_alignment(r.returned, r.shifted, r.unshifted, r.relation, r.rtol, r.shifted2)
    evidence = {
        "loss_returned": r.returned,
        "loss_shifted": r.shifted,
        "loss_unshifted": r.unshifted,
        "loss_shifted2": r.shifted2,
        "labels_relation": r.relation,
    }
    if alignment == "current":
        return True, TFD205.verdict(evidence)
    if alignment == "next_next":
        preshifted = r.relation == "preshifted"
        where = (
            "the data already holds next-token labels and the loss shifts them again"
            if preshifted
            else "the batch's labels equal its inputs and training_step shifts them twice (by hand, then again inside "
            "the model or the loss)"
        )
        two_ahead, one_ahead = (r.shifted, r.unshifted) if preshifted else (r.shifted2, r.shifted)
        return True, TFD206.verdict(evidence, where=where, two_ahead=two_ahead, one_ahead=one_ahead)
    if alignment == "next" or matched is not None:  # correct, or labels unrelated to inputs (seq2seq)
        return True, None
    if abs(r.shifted - r.unshifted) > 4 * r.rtol * max(1.0, abs(r.returned)) or r.last_try:
        # the alignments differ but the loss matches neither (label smoothing, auxiliary terms, dropout)
        detail = (
            f"the loss training_step returned ({r.returned:.6g}) matches neither the shifted ({r.shifted:.6g}) nor "
            f"the unshifted ({r.unshifted:.6g}) cross-entropy of the logits"
        )
        hint = (
            "Expected with label smoothing, auxiliary losses or a loss over other outputs; otherwise check "
            "`labels_key` and `ignore_index`."
        )
        return True, TFD210.verdict(evidence, hint=hint, state="undetermined", detail=detail)
    return False, None


def alignment_not_checked(why: str) -> Verdict:
    """``TFD210`` (info): the target alignment cannot be checked on this run (``why``: what failed)."""
    return TFD210.verdict(state="not checked", detail=why)


# -------------------------------------------------------------------------------------------------------- the model
TFD211 = Rule(
    "TFD211",
    "info",
    "MaskProbe",
    title="MaskProbe cannot call the model or read the batch; names the argument to set; stands aside",
    trigger="MaskProbe cannot call the model or read the batch; it says which argument to set and stands aside",
    details=(
        "Info, then MaskProbe stands aside: no recorded call of `training_step` took the batch's token ids and "
        "returned logits wider than every token id, `forward` cannot be called by its signature (`input_key` / "
        "`mask_key` keywords or positionally), and no `forward_fn` is given or it fails; or the batch holds no "
        "integer tensor. Also said when `kv_cache_fn` cannot be imported or returns no logits of the full forward's "
        "shape (that check alone is skipped)."
    ),
    hint="set `forward_fn` / `input_key` / `mask_key` / `labels_key`",
    reason="The probe stands aside and names the argument that would let it run; nothing was measured",
    message=("MaskProbe cannot call the model: {reason}"),
)


def cannot_call(reason: str) -> Verdict:
    """``TFD211`` (info): MaskProbe cannot call the model or read the batch, and stands aside."""
    hint = (
        "MaskProbe calls `pl_module(input_ids=..., attention_mask=...)` or `pl_module(input_ids)`; otherwise give "
        "`forward_fn` (and `input_key` / `mask_key` / `labels_key` to point at the batch's fields)."
    )
    return TFD211.verdict(hint=hint, reason=reason)


def kv_cache_unusable(error: BaseException | None = None, shape: Any = None, expected: Any = None) -> Verdict:
    """``TFD211`` (info): ``kv_cache_fn`` could not be imported (``error``), or returned no logits of the full
    forward's shape."""
    if error is not None:
        return TFD211.verdict(key="kv_cache_fn", message=f"`kv_cache_fn` could not be imported: {error}")
    return TFD211.verdict(
        key="kv_cache_shape",
        message=f"`kv_cache_fn` returned {shape}, not logits of shape {expected}; the cache check is skipped.",
    )


TFD212 = Rule(
    "TFD212",
    "info",
    "MaskProbe",
    title="with `causal=None`, the model measured bidirectional and its labels not next-token: treated as an encoder",
    trigger=(
        "`causal=None`, the labels are neither the inputs nor the next inputs at most supervised positions "
        "(masked-LM / denoising) and the model measured bidirectional: causality and target alignment are not checked"
    ),
    details=(
        "Info, at the first probe with `causal=None` and no model kind that decides it: the labels equal the inputs "
        "at less than half of the supervised positions and the next inputs at less than half of those that have a "
        "next input (a masked-LM or denoising objective), and replacing the tokens after the middle of the probe rows "
        "moves the outputs at and before it beyond fp32's tolerance (a bidirectional model; a model measured "
        "causal gets `TFD210` instead). When the kind cannot be measured (a forward that does not repeat, fewer than "
        "4 tokens, a call that takes no token ids), it is read from the labels alone. Causality and target alignment "
        "are then not checked."
    ),
    hint="If this model is a decoder, set `causal=True` to check its causal mask; `causal=False` silences this.",
    reason="An observation of the objective (a masked-LM or denoising task), which makes the causal probes not apply",
    message=(
        "Treated as an encoder: {measured}; at the supervised positions the labels equal the inputs {same_frac:.0%} of "
        "the time and the next inputs {next_frac:.0%} (a next-token objective has one of them near 100%), so the "
        "objective is masked-LM or denoising. Causality and target alignment are not checked."
    ),
)


def decide_objective(objective: Objective, measured: str = "the kind was read from the labels") -> Verdict | None:
    """Decoder (None) or encoder (``TFD212``), from what the labels ask the model to predict; ``measured``: what the
    kind's measurement found (:mod:`.kind_checks`)."""
    if objective.next_token:
        return None
    supervised_next = max(objective.supervised_next, 1.0)
    evidence = {
        "same_frac": objective.same / objective.supervised,
        "next_frac": objective.following / supervised_next,
        "supervised_frac": objective.supervised / max(objective.label_positions, 1),
    }
    return TFD212.verdict(evidence, measured=measured)


BLOCK = ("TFD201", "TFD219")
"""The codes reserved for MaskProbe's rules."""

RULES: tuple[Rule, ...] = (
    TFD205,
    TFD206,
    TFD210,
    TFD211,
    TFD212,
)
"""The rules decided in this module, in code order."""
