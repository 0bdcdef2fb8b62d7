"""LossAtInit's decisions, without a Trainer: the first loss and the model's outputs (``TFD220``-``TFD224``,
``TFD227``-``TFD229``), the check (``TFD225``, ``TFD226``, ``TFD230``-``TFD232``) and the returned loss against the
logits' own cross-entropy (``TFD233``-``TFD235``), from host readings of the reduced sums of
:func:`~lightning_tfdebug.functional.loss.step_sums`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_tfdebug.functional.learning import trained_before
from lightning_tfdebug.functional.loss import CAP_GRID, OTHER_ALIGNMENT, TEMPERATURE_GRID, uniform_loss
from lightning_tfdebug.functional.verdicts import Rule, Verdict

_CONTEXT_HEAD = (
    "At step {step} the loss {loss:.3f} sits at the labels' unigram entropy ({unigram_entropy:.3f}: token frequencies "
    "only), and the model predicts its own sample's labels no better than its neighbour's ({rolled_loss:.3f} with the "
    "labels rolled by one sample)"
)
"""The first sentence of ``TFD231`` and ``TFD232``."""
_TRANSFORM_HEAD = (
    "From step {first_step} to step {last_step} the loss training_step returned ({returned}) is not the cross-entropy "
    "of the model's logits ({logits_ce})"
)
"""The first sentence of ``TFD233``-``TFD235``."""

TFD220 = Rule(
    "TFD220",
    "error",
    "LossAtInit",
    title="the outputs are probabilities: softmax before a loss that applies it again (loss stuck at ln(V))",
    trigger=(
        "at step 0, >= 99% of the sampled output rows are non-negative and sum to 1: `forward` returns "
        "probabilities (a cross-entropy then applies softmax again and the loss sits at ln(V))"
    ),
    hint=(
        "Return raw logits from forward (remove the softmax) and apply softmax only at inference. If the loss is "
        "NLLLoss, feed it log_softmax(logits) instead of probabilities."
    ),
    reason="Softmax applied twice holds the loss near ln(V) with vanishing gradients: the run cannot learn",
    message=(
        "The model's outputs are already probabilities: {probability_rows:.0%} of the sampled rows are non-negative "
        "and sum to 1. A loss that applies softmax again (cross_entropy) sees a nearly uniform distribution and stays "
        "at ln(V) = {expected_loss:.3f}."
    ),
)

TFD221 = Rule(
    "TFD221",
    "info",
    "LossAtInit",
    title="the outputs are log-probabilities (fine for NLLLoss and cross_entropy)",
    trigger="at step 0, >= 99% of the sampled output rows are log-probabilities (all <= 0, logsumexp 0)",
    hint=(
        "Nothing to fix if the loss is NLLLoss or cross_entropy. Make sure nothing applies softmax to them as if "
        "they were probabilities."
    ),
    reason="An observation: log-probabilities are correct input to NLLLoss and harmless to cross_entropy",
    message=(
        "The model's outputs are log-probabilities ({log_probability_rows:.0%} of the sampled rows have logsumexp 0). "
        "That is right for NLLLoss and harmless for cross_entropy (log_softmax is idempotent)."
    ),
)

TFD222 = Rule(
    "TFD222",
    "warning",
    "LossAtInit",
    title="the step-0 loss far above ln(V): logits too large at init",
    trigger="the step-0 loss is above `(1 + init_tolerance) ln(V)`",
    hint=(
        "The logits are too large at init: initialise the output layer with a small std (e.g. 0.02 or "
        "1/sqrt(d_model)), keep the 1/sqrt(d) attention/residual scaling, check a tied embedding's scale. Or the "
        "loss is not a mean (reduction='sum')."
    ),
    reason="Measured at step 0: confidently wrong logits, which saturate the softmax's gradient",
    message=(
        "The initial loss {observed_loss:.3f} is far above ln(V) = {expected_loss:.3f} (V={vocab_size}): the untrained "
        "model is confidently wrong (logit spread {logit_std:.3g})."
    ),
)

TFD223 = Rule(
    "TFD223",
    "warning",
    "LossAtInit",
    title=(
        "the step-0 loss far below ln(V): the loss is not the logits' V-way cross-entropy, or the target leaks "
        "into the input (info for a pretrained model)"
    ),
    trigger=(
        "the step-0 loss is below `(1 - init_tolerance) ln(V)` and the logits' own cross-entropy is not, or the "
        "logits reach it by predicting the current input token; info when the logits give that loss themselves "
        "without copying (weights trained before: fine-tuning)"
    ),
    hint=(
        "Usual causes: the target leaks into the input (labels not shifted and the model copies its input, no "
        "causal mask); NLLLoss fed raw logits or probabilities instead of log_softmax; the mean taken over "
        "padding positions (set ignore_index); a vocab_size different from the logits' width."
    ),
    reason="Measured at step 0: the loss is not the logits' cross-entropy, or they read the answer from the input",
    message=(
        "The initial loss {observed_loss:.3f} is far below ln(V) = {expected_loss:.3f} (V={vocab_size}){explanation}."
    ),
)

TFD224 = Rule(
    "TFD224",
    "error",
    "LossAtInit",
    title="no supervised tokens: every label is `ignore_index`",
    trigger=("no label of the first batch is supervised (all `ignore_index` after alignment): the loss is NaN or 0"),
    hint=(
        "Check the collator/labels: labels set to ignore_index everywhere (a mask inverted, the prompt mask "
        "covering the whole sequence, truncation cutting every answer). With shift_labels=True only labels after "
        "the first position count."
    ),
    reason="With no supervised label the loss is 0 or NaN: nothing can be learned as configured",
    message=(
        "No supervised tokens: every label of the first batch is ignore_index ({ignore_index}), so the loss is "
        "{observed_loss:.4g} (NaN or 0) and nothing is learned."
    ),
)

TFD225 = Rule(
    "TFD225",
    "warning",
    "LossAtInit",
    title='at the check the loss is still at ln(V), flat over a window ("stalled at the uniform loss")',
    trigger=(
        "at `check_step` (5x for masked-LM labels) the training loss is within `stall_tolerance` of ln(V) and fell"
        " by less than `stall_tolerance` of ln(V) since half-way to the check; the message compares it with the "
        "labels' unigram entropy"
    ),
    hint=(
        "Usual causes: softmax applied in forward before a cross-entropy (double softmax, see TFD220); a learning"
        " rate far too low or still in warm-up; parameters not in the optimizer; the loss detached from the "
        "graph. Run the overfit-one-batch test."
    ),
    reason="Measured: the loss has not left ln(V) by the check, so the run so far has learned nothing",
    message=(
        "From step {window_start} to step {step} the loss stayed flat at {loss:.3f}, within {tolerance:.0%} of "
        "ln(V) = {expected_loss:.3f}, {what}."
    ),
)

TFD226 = Rule(
    "TFD226",
    "warning",
    "LossAtInit",
    title="at `check_step` the model predicts its current input token: labels not shifted",
    trigger=(
        "at `check_step` the argmax equals the current input token at more than `copy_threshold` of positions, "
        "0.25 above the data's own repeat rate, and 0.1 above the rate at step 0 (tied embeddings copy from init)"
    ),
    hint=(
        "The labels are not shifted: position t is trained to predict token t, which it can see. Shift them "
        "(logits[:, :-1] against labels[:, 1:]) in the loss or the collator, not both."
    ),
    reason="Measured: the trained model predicts its current input token, the harm of labels that are not shifted",
    message=(
        "After {step} steps the model's top prediction equals the *current* input token at {copy_rate:.0%} of "
        "positions (the data repeats a token at only {repeat_rate:.0%}; at init the model did so at "
        "{init_copy_rate:.0%}): it learned to copy its input."
    ),
)

TFD227 = Rule(
    "TFD227",
    "error",
    "LossAtInit",
    title="the step-0 loss is not finite although labels are supervised",
    trigger="the step-0 loss is NaN/inf although labels are supervised",
    hint=(
        "Look for log(0), division by zero or an overflow in the forward or the loss; NaNFirstFrame names the "
        "first module that produced a non-finite value."
    ),
    reason="A loss that is not finite before any update turns the first step's weights into NaN",
    message="The loss of the first step is {observed_loss}, before any update.",
)

TFD228 = Rule(
    "TFD228",
    "info",
    "LossAtInit",
    title="logits or labels cannot be found; names the argument to set, then stands aside",
    trigger="the logits or labels cannot be found; LossAtInit names the argument to set and stands aside",
    hint="Set the named argument; LossAtInit does nothing else in this run.",
    reason="The check stands aside and names the argument that would let it run; nothing was measured",
    message="LossAtInit cannot read the model's outputs or labels: {reason}.",
)

TFD229 = Rule(
    "TFD229",
    "warning",
    "LossAtInit",
    title="the returned loss is a multiple of its logits' cross-entropy (summed, or divided twice)",
    trigger=(
        "the step-0 logits give a cross-entropy within `init_tolerance` of ln(V) but the returned loss is outside"
        " that band: above by any factor, below by one over a count of the batch (rows, tokens, accumulation, "
        "ranks)"
    ),
    hint=(
        "Average the loss over supervised tokens (cross_entropy's default reduction='mean', or divide a sum by "
        "(labels != ignore_index).sum()); do not divide by accumulate_grad_batches yourself (Lightning does); "
        "weight extra loss terms so they do not dominate. A summed loss makes the step size depend on the batch "
        "and sequence length; with Adam it also breaks gradient clipping and the epsilon balance."
    ),
    reason="Measured: the loss and every gradient are scaled by a count of the batch: the step size is not the set one",
    message=(
        "The loss training_step returned ({returned:.4g}) is {factor:.4g}x the mean cross-entropy of the model's own "
        "logits ({logits_loss:.4g}, at ln(V) = {uniform:.3f} as an untrained model should be){because}. The logits "
        "are fine; the loss is scaled, and with it the gradients."
    ),
)

TFD230 = Rule(
    "TFD230",
    "warning",
    "LossAtInit",
    title="the loss is pinned at the floor of outputs squashed into a bounded range (sigmoid, tanh, clamp)",
    trigger=(
        "at the check the logits' cross-entropy has left ln(V) and lies within 30% of the way from the floor "
        "`ln(1 + (V-1) e^-w)` of the rows' logit ranges `w` up to ln(V), the floor is 5% of ln(V) above the labels' "
        "unigram entropy, and the rows' ranges are alike (spread at most 5% of their mean)"
    ),
    hint=(
        "Feed the loss raw, unbounded logits: remove the sigmoid, tanh, clamp or normalisation applied to the "
        "output layer (or move it to inference). For logits confined to a range of width w, no cross-entropy over"
        " V classes is below ln(1 + (V-1) e^-w), whatever the model learns."
    ),
    reason="Measured: the loss sits on the floor that bounded outputs allow, above what the data allows",
    message=(
        "At step {step} the loss {loss:.3f} sits on the floor its outputs allow ({floor:.3f}): the logits span a "
        "range of only {logit_range:.3g} per position, and no cross-entropy over V={classes} classes of such logits "
        "can fall below ln(1 + (V-1) e^-range). The labels' unigram entropy is {unigram_entropy:.3f}, so the outputs "
        "are squashed into a bounded range before the loss (a sigmoid, tanh, clamp or normalisation on the logits)."
    ),
)

TFD231 = Rule(
    "TFD231",
    "warning",
    "LossAtInit",
    title="labels from other samples: the loss sits at the unigram entropy and ignores which sample it is",
    trigger=(
        "at the check the loss is at the labels' unigram entropy (0.85x to 1.1x), the loss against labels rolled "
        "by one sample along the batch is within 1% of it, and the labels do not repeat their own inputs more "
        "than a neighbour's (masked-LM labels: do not sit on their own inputs' mask tokens more than on a "
        "neighbour's); info when the labels' relation to the inputs cannot be measured (an encoder-decoder)"
    ),
    hint=(
        "The labels do not belong to their inputs: look for an off-by-one in the join of inputs and labels, a "
        "label column shuffled or sorted separately from the inputs, or labels built from another batch. For a "
        "task whose labels never repeat the input (classification, translation), the model may instead ignore "
        "its inputs: check what reaches the model."
    ),
    reason="Measured: the loss stopped at token frequencies, whichever sample the labels are scored against",
    message=_CONTEXT_HEAD + ": {why}.",
)

TFD232 = Rule(
    "TFD232",
    "warning",
    "LossAtInit",
    title="the model ignores its context: the loss stalls at the labels' unigram entropy (token frequencies only)",
    trigger=(
        "at the check the loss is flat at the labels' unigram entropy (0.85x to 1.1x), the loss against labels "
        "rolled by one sample is within 1% of it, and the labels repeat their own inputs (so they are right); "
        "info for masked-LM labels that sit on their own inputs' mask tokens (the masked-LM plateau, longer at a "
        "lower learning rate)"
    ),
    hint=(
        "The model predicts from token frequencies alone: its inputs do not reach the prediction. Look for an "
        "attention mask that hides every token, inputs replaced or zeroed before the model (the wrong key, an "
        "embedding never used), a residual path that drops the context, or a learning rate too low to get past "
        "the plateau."
    ),
    reason="Measured: the loss is flat at token frequencies and the labels are right: the model ignores its context",
    message=_CONTEXT_HEAD + ". The labels {relation}, so they are right: {conclusion}.",
)

TFD233 = Rule(
    "TFD233",
    "warning",
    "LossAtInit",
    title="the returned loss stays far above the logits' own cross-entropy: a bound or squash before the loss",
    trigger=(
        "on every compared step (at least two) the returned loss is above the recorded logits' cross-entropy by 20% "
        "of it and 10% of ln(V), not explained by label smoothing (at most 0.3) or a temperature, and fell by less "
        "than 0.9x what the cross-entropy fell (an added term such as distillation falls with it); or it is pinned: "
        "it fell by at most 4% while the logits' range grew by 10% (the message then names the width w whose floor "
        "ln(1 + (V-1) e^-w) the loss sits on); or it is the cross-entropy of c * tanh(logits / c) for one c at every "
        "compared step (within 3%, closer than any temperature) and that cap keeps every token below probability 1/2 "
        "or the loss above what the logits reach"
    ),
    hint=(
        "Give the loss the raw logits: remove the sigmoid, soft-cap c * tanh(logits / c) with c too small, clamp or "
        "normalisation in training_step or the loss module, or apply it only where probabilities are needed."
    ),
    reason="Measured: the minimised loss stays far above what the model's own logits give; training cannot close it",
    message=_TRANSFORM_HEAD
    + (
        ": at step {last_step} the loss is {last_loss:.4g}, {gap:.3g} nats above the logits' own {last_ce:.4g}"
        "{detail}. Something between the model's output and the loss squashes or bounds the logits (a sigmoid, tanh, "
        "clamp or normalisation in training_step or a loss wrapper), and the loss trains the squashed logits."
    ),
)

TFD234 = Rule(
    "TFD234",
    "info",
    "LossAtInit",
    title="the returned loss is the cross-entropy of the logits divided by a temperature T",
    trigger=(
        "on every compared step the returned loss differs from the recorded logits' cross-entropy by more than 3% "
        "and equals the cross-entropy of logits / T for one T (within 3%) at all of them, T outside [0.8, 1.25]"
    ),
    hint=(
        "If the temperature is deliberate, use the same T wherever the logits are read (evaluation, sampling, a "
        "validation loss); if not, remove the division or multiplication of the logits before the loss."
    ),
    reason="An observation: the run trains; the harm, if any, is in code that reads the logits without the temperature",
    message=_TRANSFORM_HEAD
    + (
        ": it is the cross-entropy of logits / T with T = {temperature:.3g} at every compared step. The loss trains "
        "logits / {temperature:.3g}, so the model's own logits are {temperature:.3g}x {direction} than its "
        "predictions during training: anything that reads them without that temperature (evaluation, sampling, a "
        "validation loss) sees another model."
    ),
)

TFD235 = Rule(
    "TFD235",
    "info",
    "LossAtInit",
    title="the returned loss is not the cross-entropy of the model's logits, and no known transform explains it",
    trigger=(
        "on every compared step the returned loss differs from the recorded logits' cross-entropy by more than "
        "3%, and neither a bound or a loss far above them (TFD233), label smoothing, a temperature (TFD234), a "
        "constant factor nor an added term of at most 20% explains it; the message gives both numbers"
    ),
    hint=(
        "Check what training_step does to the logits before the loss, or point `logits_module` at the module "
        "whose output the loss reads."
    ),
    reason="An observation: the disagreement is measured, but no harm to this run is",
    message=_TRANSFORM_HEAD
    + (
        ", and no bound, label smoothing, temperature, constant factor or small added term explains it: at step "
        "{last_step} the returned loss is {last_loss:.4g}, the logits' cross-entropy {last_ce:.4g}."
    ),
)

BLOCK = ("TFD220", "TFD239")
"""The codes reserved for LossAtInit's rules."""

RULES: tuple[Rule, ...] = (
    TFD220,
    TFD221,
    TFD222,
    TFD223,
    TFD224,
    TFD225,
    TFD226,
    TFD227,
    TFD228,
    TFD229,
    TFD230,
    TFD231,
    TFD232,
    TFD233,
    TFD234,
    TFD235,
)
"""The rules decided in this module, in code order."""

MASKED_LM_SHARE = 0.5
"""Masked-LM labels: one input token (the mask) fills at least this share of the supervised positions ..."""
MASKED_LM_SUPERVISED = 0.5
"""... and at most this fraction of the label positions is supervised (BERT masks 15%)."""
MASKED_LM_CHECK_FACTOR = 5
"""Masked-LM objectives sit at the unigram entropy longer: their check runs this many times later."""
CONTEXT_GAP = 0.01
"""TFD231/TFD232: the own labels' loss beats the neighbour's by less than this fraction."""
UNIGRAM_BAND = (0.85, 1.1)
"""The loss counts as "at the unigram entropy" between these multiples of it."""
FLOOR_PINNED = 0.3
"""TFD230: the loss is above the floor by at most this fraction of the way up to ln(V) (healthy runs: 0.4 and more)."""
FLOOR_ABOVE_DATA = 0.05
"""... and the floor is above the labels' unigram entropy by at least this fraction of ln(V) ..."""
RANGE_SPREAD = 0.05
"""... and the rows' ranges spread by at most this fraction of their mean (a saturated tanh: 0.009; healthy: 0.12)."""
STALL_STEPS = 20
"""TFD232 claims a stall at the unigram entropy only over a window of at least this many steps."""
RELATION_MARGIN = 0.2
"""Labels belong to inputs (own or the neighbour's) that they repeat at half the positions and this much more often."""
COPY_RISE = 0.1
"""TFD226 needs the copy rate to have risen by this much since init (tied embeddings copy from the start)."""
NORMALIZED_ROWS = 0.99
"""Fraction of sampled rows that must be probabilities (or log-probabilities) for TFD220 (TFD221)."""
_COUNT_MATCH = math.log(1.15)
"""A loss factor within 15% of a count of the batch names it."""

# the returned loss against the logits' own cross-entropy (measured values: docs/callbacks/loss_at_init.md)
AGREE = 0.03
"""The returned loss agrees with the logits' cross-entropy within this fraction (or three standard errors)."""
PINNED_FALL = 0.04
"""A bound pins the loss: it fell by at most this fraction of itself over the compared steps ..."""
LOSS_FOLLOWS = 0.5
"""... or by less than this fraction of the logits' own cross-entropy's fall ..."""
PINNED_GAP = 0.1
"""... and sits this fraction of ln(V) above what the logits reach at their best temperature ..."""
RANGE_GROWTH = 0.1
"""... while the logits' range grew by at least this fraction (a squash keeps pushing its input outwards)."""
FAR_ABOVE = 0.1
"""TFD233 without a floor: the loss is above the logits' cross-entropy by this fraction of ln(V) and ADDED_TERM."""
SMOOTHING_SPREAD = (0.01, 0.1)
"""Label smoothing: ``e = (loss - ce) / (uniform - ce)`` is the same at every step within ``max(0.01, 0.1 e)`` ..."""
MAX_SMOOTHING = 0.3
"""... and at most this (a soft-cap far too small mimics a steady ``e`` of 0.35 to 0.5)."""
TEMPERATURE_MATCH = 0.03
"""A temperature: one multiplier ``b = 1/T`` gives the loss at every compared step within this fraction ..."""
TEMPERATURE_MIN = math.log(1.25)
"""... and ``|ln b|`` is at least this."""
SCALE_SPREAD = math.log(1.1)
"""A constant factor (``loss / k`` for manual accumulation): ``loss / ce`` varies by at most 10%."""
ADDED_TERM = 0.2
"""An added term (z-loss, auxiliary loss) lifts the loss above the logits' cross-entropy by at most this fraction."""
ADDED_FOLLOWS = 0.9
"""A larger added term is told from a bound by the loss falling with the logits' cross-entropy: this fraction of it."""

COMPARE_FRACTIONS = (0.5, 0.75)
"""Besides the check, the returned loss is compared with the recorded logits on the first measuring steps at or after
these fractions of the way to it."""


def compare_steps(check_at: int | None, interval: int) -> tuple[int, ...]:
    """The measuring steps (multiples of ``interval``) before the check at or after :data:`COMPARE_FRACTIONS` of the
    way to it (from steps alone: every rank compares on the same steps)."""
    if check_at is None:
        return ()
    steps = (-(-math.ceil(check_at * f) // interval) * interval for f in COMPARE_FRACTIONS)
    return tuple(sorted({s for s in steps if 0 < s < check_at}))


# ---------------------------------------------------------------------------------------------------- readings
def _mean(total: float, count: float, default: float = float("nan")) -> float:
    return total / count if count else default


def returned_loss(host: Mapping[str, float]) -> float:
    """The loss ``training_step`` returned, averaged over the ranks that returned one (``loss_sum`` / ``loss_n``);
    NaN when none did."""
    return _mean(host["loss_sum"], host["loss_n"])


@dataclass(frozen=True)
class InitLoss:
    """The first step's loss and outputs, from the reduced sums (host floats)."""

    observed: float  # the loss training_step returned (averaged over ranks), else the recomputed one
    expected: float  # ln(V)
    recomputed: float  # cross-entropy of the captured logits against the labels
    logit_std: float  # root mean of the per-row variances across the vocabulary
    supervised_frac: float
    copy_rate: float | None  # argmax == current input token, None when not measured
    probability_rows: float  # fraction of sampled rows that are probabilities
    log_probability_rows: float
    supervised: float  # labels that are not ignore_index, over every rank
    positions: float  # label positions, over every rank
    label_rows: float  # sequences, over every rank
    vocab: int
    repeat_rate: float | None = None  # the data repeats a token (inputs[t] == inputs[t + 1]); None when not measured
    mask_share: float | None = None  # share of supervised positions holding the most common input token
    kind: str = "unknown"  # model_kind's: an encoder-decoder's copy rate reads its decoder input

    @property
    def masked_lm(self) -> bool:
        """Masked-LM labels: a few positions supervised, and most of their inputs one token (the mask)."""
        return (
            self.mask_share is not None
            and self.mask_share >= MASKED_LM_SHARE
            and 0 < self.supervised_frac <= MASKED_LM_SUPERVISED
        )

    @property
    def probabilities(self) -> bool:
        """The outputs are probabilities (``TFD220``): the check's bounded-output floor is then that finding's."""
        return self.probability_rows >= NORMALIZED_ROWS

    def metrics(self) -> dict[str, float]:
        """The logged keys of step 0."""
        out = {
            "loss_at_init/observed": self.observed,
            "loss_at_init/expected": self.expected,
            "loss_at_init/recomputed": self.recomputed,
            "loss_at_init/logit_std": self.logit_std,
            "loss_at_init/supervised_frac": self.supervised_frac,
        }
        if self.copy_rate is not None:
            out["loss_at_init/copy_rate"] = self.copy_rate
        return out


def follow_returned_loss(host: Mapping[str, float], observed: float) -> tuple[dict[str, float], bool]:
    """The sums of the label alignment (``t`` or ``t + 1``) whose recomputed cross-entropy is closer to the returned
    loss: ``shift_labels`` can only assume who shifts the labels, the returned loss says it (a trained model's
    logits give its loss only under the right one). ``host`` holds both (:data:`OTHER_ALIGNMENT`).

    Returns the values with the matching alignment's sums under the plain names, and whether that is the other one.
    """
    out = {k: v for k, v in host.items() if not k.startswith(OTHER_ALIGNMENT)}
    count, other_count = host.get("ce_count", 0.0), host.get(OTHER_ALIGNMENT + "ce_count", 0.0)
    if not (count and other_count and math.isfinite(observed)):
        return out, False
    configured = host["ce_sum"] / count
    other = host[OTHER_ALIGNMENT + "ce_sum"] / other_count
    if not (math.isfinite(other) and abs(observed - other) < abs(observed - configured)):
        return out, False
    for key, value in host.items():
        if key.startswith(OTHER_ALIGNMENT):
            out[key[len(OTHER_ALIGNMENT) :]] = value
    return out, True


def summarize_init(host: Mapping[str, float], vocab: int, kind: str = "unknown") -> InitLoss:
    """:class:`InitLoss` from step 0's reduced sums and the returned loss (``loss_sum`` / ``loss_n``)."""
    recomputed = _mean(host["ce_sum"], host["ce_count"])
    rows = max(host["rows"], 1.0)
    return InitLoss(
        observed=_mean(host["loss_sum"], host["loss_n"], recomputed),
        expected=uniform_loss(vocab),
        recomputed=recomputed,
        logit_std=math.sqrt(max(host["var_sum"], 0.0) / rows),
        supervised_frac=_mean(host["supervised"], host["positions"], 0.0),
        copy_rate=_mean(host["copies"], host["count"]) if host.get("count") else None,
        probability_rows=host["prob_rows"] / rows,
        log_probability_rows=host["logprob_rows"] / rows,
        supervised=host["supervised"],
        positions=host["positions"],
        label_rows=host["label_rows"],
        vocab=vocab,
        repeat_rate=_mean(host.get("repeats", 0.0), host["count"]) if host.get("count") else None,
        mask_share=_mean(host["mask_share_top"], host["mask_share_count"]) if host.get("mask_share_count") else None,
        kind=kind,
    )


def late_masked_lm(host: Mapping[str, float]) -> bool:
    """Masked-LM labels, read at the check of a run resumed without step 0's reading (:data:`LATE_SUMS`)."""
    if not host["late_mask_count"] or not host["late_positions"]:
        return False
    share = host["late_mask_top"] / host["late_mask_count"]
    supervised = host["late_supervised"] / host["late_positions"]
    return share >= MASKED_LM_SHARE and 0 < supervised <= MASKED_LM_SUPERVISED


@dataclass(frozen=True)
class CheckReading:
    """The check's measurements under the alignment the returned loss follows (host floats; NaN: not measured)."""

    loss: float  # the loss training_step returned (averaged over ranks), else the recomputed one
    recomputed: float  # the logits' own cross-entropy
    expected: float  # ln(V)
    copy_rate: float = math.nan  # argmax == current input token
    repeat_rate: float = math.nan  # the data repeats a token
    own_loss: float = math.nan  # cross-entropy against the sample's own labels, where the rolled ones are supervised
    rolled_loss: float = math.nan  # ... against the labels rolled by one sample along the batch
    floor: float = math.nan  # mean of ln(1 + (V-1) e^-w), w a row's logit range
    logit_range: float = math.nan  # mean of w
    range_spread: float = math.nan  # standard deviation of w over its mean
    own_match: float = math.nan  # share of supervised labels repeating their own inputs (masked LM: on their masks)
    rolled_match: float = math.nan  # ... the neighbour's inputs
    copy_positions: float = 0.0  # positions the copy rate counted
    rolled_rows: float = 0.0  # rows the rolled loss counted
    floor_rows: float = 0.0  # rows the floor counted

    def metrics(self) -> dict[str, float]:
        """The logged keys of the check (what it measured)."""
        out = {"loss_at_init/check_loss": self.loss}
        if self.copy_positions:
            out["loss_at_init/copy_rate"] = self.copy_rate
        if self.rolled_rows:
            out["loss_at_init/rolled_loss"] = self.rolled_loss
        if self.floor_rows:
            out["loss_at_init/loss_floor"] = self.floor
        return out


def check_reading(host: Mapping[str, float], vocab: int) -> CheckReading:
    """:class:`CheckReading` from the check's reduced sums, under the alignment :func:`follow_returned_loss` chose."""
    recomputed = _mean(host["ce_sum"], host["ce_count"])
    count, rolled, floor, matched = host["count"], host["rolled_count"], host["floor_count"], host["match_count"]
    logit_range, spread = _mean(host["range_sum"], floor), math.nan
    if floor:
        spread_sq = host["range_sq_sum"] / floor - logit_range**2
        spread = math.sqrt(max(spread_sq, 0.0)) / logit_range if logit_range > 0 else math.nan
    return CheckReading(
        loss=_mean(host["loss_sum"], host["loss_n"], recomputed),
        recomputed=recomputed,
        expected=uniform_loss(vocab),
        copy_rate=_mean(host["copies"], count),
        repeat_rate=_mean(host["repeats"], count),
        own_loss=_mean(host["own_ce_sum"], rolled),
        rolled_loss=_mean(host["rolled_ce_sum"], rolled),
        floor=_mean(host["floor_sum"], floor),
        logit_range=logit_range,
        range_spread=spread,
        own_match=_mean(host["own_match"], matched),
        rolled_match=_mean(host["rolled_match"], matched),
        copy_positions=count,
        rolled_rows=rolled,
        floor_rows=floor,
    )


HISTORY = 64
"""Measured losses kept for the stall window."""
_RUN_FLAGS = ("init_done", "check_done", "masked_lm", "probabilities", "token_rows")


@dataclass
class LossRun:
    """What LossAtInit has read over the run so far, and which steps it measures next (host values: its checkpointed
    state, :meth:`to_state` / :meth:`from_state`).

    Attributes:
        check_step: the configured step of the check (None: no check).
        check_at: the check's step: ``check_step``, or :data:`MASKED_LM_CHECK_FACTOR` times it for masked-LM labels.
        init_done, check_done: step 0 and the check were armed.
        init_copy_rate: the untrained model's copy rate (tied embeddings copy from the start); None: not measured.
        masked_lm: the labels are masked-LM labels (aligned with the logits; a later check).
        vocab: V, once known.
        probabilities: step 0 found probabilities (``TFD220``): the check's bounded-output floor is that finding's.
        token_rows: the labels are the batch's token rows (a loss-only wrapper): the measuring steps count those.
        history: ``(step, loss)`` of the measuring steps, for the stall window (the last :data:`HISTORY`).
        compared: the compared steps before the check that were armed.
        readings: the returned loss against the recorded logits on the compared steps and the check.
    """

    check_step: int | None
    check_at: int | None
    init_done: bool = False
    check_done: bool = False
    init_copy_rate: float | None = None
    masked_lm: bool = False
    vocab: int | None = None
    probabilities: bool = False
    token_rows: bool = False
    history: list[tuple[int, float]] = field(default_factory=list)
    compared: list[int] = field(default_factory=list)
    readings: list[LossReading] = field(default_factory=list)

    def compare_steps(self, interval: int) -> tuple[int, ...]:
        return compare_steps(self.check_at, interval)

    def arm(self, step: int, interval: int) -> str | None:
        """The phase the first micro-batch of ``step`` is armed for, now marked as taken: ``"init"`` (step 0),
        ``"check"`` or ``"compare"``; None for any other step."""
        if step == 0 and not self.init_done:
            self.init_done = True
            return "init"
        if self.check_at is not None and step == self.check_at and not self.check_done:
            self.check_done = True
            return "check"
        if step in self.compare_steps(interval) and step not in self.compared:
            self.compared.append(step)
            return "compare"
        return None

    def start(self, init: InitLoss) -> None:
        """Keep what step 0 showed: the copy rate, masked-LM labels (whose check moves later), probabilities."""
        if init.copy_rate is not None:
            self.init_copy_rate = init.copy_rate
        self.masked_lm = init.masked_lm
        if init.masked_lm and self.check_step is not None:
            self.check_at = MASKED_LM_CHECK_FACTOR * self.check_step
        self.probabilities = init.probabilities

    def check_moves(self, host: Mapping[str, float], step: int) -> bool:
        """Masked-LM labels recognised at the check of a run resumed without step 0's reading; True when their check
        moved later (``MASKED_LM_CHECK_FACTOR * check_step``: nothing is judged at this step)."""
        if self.init_done or self.masked_lm or not late_masked_lm(host):
            return False
        self.masked_lm = True
        later = MASKED_LM_CHECK_FACTOR * self.check_step if self.check_step is not None else None
        if later is None or step >= later:
            return False  # judged now, as a masked LM
        self.check_at, self.check_done = later, False
        return True

    def keep_loss(self, step: int, loss: float, unigram_entropy: float | None) -> dict[str, float]:
        """Keep a measured loss for the stall window; returns the finite ones of the dashboard's keys: the loss between
        its two baselines, ln(V) and the labels' unigram entropy (once known)."""
        self.history = [*self.history, (step, loss)][-HISTORY:]
        metrics = {"loss_at_init/loss": loss}
        if self.vocab is not None:
            metrics["loss_at_init/ln_vocab"] = uniform_loss(self.vocab)
        if unigram_entropy is not None:
            metrics["loss_at_init/unigram_entropy"] = unigram_entropy
        return {k: v for k, v in metrics.items() if math.isfinite(v)}

    def window(self, step: int) -> list[tuple[int, float]]:
        """The losses measured since half-way to the check at ``step`` (before it)."""
        return [(s, v) for s, v in self.history if s >= step // 2]

    def add_reading(self, reading: LossReading) -> None:
        self.readings = [*self.readings, reading][-(len(COMPARE_FRACTIONS) + 1) :]

    def to_state(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in (*_RUN_FLAGS, "init_copy_rate", "check_at", "vocab")}
        history = [list(point) for point in self.history]
        readings = [r.to_list() for r in self.readings]
        return {**state, "history": history, "compared": list(self.compared), "loss_readings": readings}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], check_step: int | None, vocab: int | None = None) -> LossRun:
        """The run as :meth:`to_state` left it (missing entries: a fresh run's); ``vocab``: V if the state has none."""
        rate = state.get("init_copy_rate")
        return cls(
            check_step=check_step,
            check_at=state.get("check_at", check_step),
            init_copy_rate=float(rate) if rate is not None else None,
            vocab=state.get("vocab") or vocab,
            history=[(int(s), float(v)) for s, v in state.get("history", [])],
            compared=[int(s) for s in state.get("compared", [])],
            readings=[LossReading.from_list(r) for r in state.get("loss_readings", [])],
            **{name: bool(state.get(name, False)) for name in _RUN_FLAGS},
        )


# ---------------------------------------------------------------------------------------------------- step 0
def unreadable_verdict(reason: str, labels_key: Any, logits_module: str | None, step: int | None = None) -> Verdict:
    """``TFD228``: the logits or labels cannot be found; ``reason`` names the argument to set."""
    return TFD228.verdict({"labels_key": labels_key, "logits_module": logits_module}, step=step, reason=reason)


def classify_init_loss(
    init: InitLoss,
    *,
    init_tolerance: float,
    ignore_index: int,
    shifted: bool,
    accumulate_grad_batches: int = 1,
    ranks: int = 1,
    manual_optimization: bool = False,
    step: int | None = None,
) -> list[Verdict]:
    """The findings of the first loss (measured at ``step``): probabilities (``TFD220``) or log-probabilities
    (``TFD221``); then, first match wins: no supervised label (``TFD224``), a loss that is not finite (``TFD227``),
    probabilities (nothing more), a multiple of the logits' own cross-entropy (``TFD229``), a loss far above
    (``TFD222``) or below (``TFD223``) ln(V). ``manual_optimization``: a loss divided by a whole number is then
    accumulation by hand.
    """
    observed, expected = init.observed, init.expected
    evidence: dict[str, Any] = {
        "observed_loss": observed,
        "expected_loss": expected,
        "vocab_size": init.vocab,
        "recomputed_loss": init.recomputed,
        "logit_std": init.logit_std,
        "shift_labels": shifted,
    }
    out = [output_kind_verdict(init, evidence)]
    if init.supervised == 0:
        out.append(
            TFD224.verdict({**evidence, "label_positions": init.positions, "supervised": 0}, ignore_index=ignore_index)
        )
    elif not math.isfinite(observed):
        out.append(TFD227.verdict(evidence))
    elif not init.probabilities and not (manual_optimization and _divided_by_whole_number(observed, init.recomputed)):
        # (probabilities: the loss value says nothing more about the wiring; a manual `loss / k`: accumulation by hand)
        counts = batch_counts(init.supervised, init.label_rows, init.positions, accumulate_grad_batches, ranks)
        out.append(_loss_scale_verdict(init, init_tolerance, counts, evidence))
    return [dataclasses.replace(v, step=step) for v in out if v is not None]


def _loss_scale_verdict(
    init: InitLoss, tolerance: float, counts: Mapping[str, float], evidence: Mapping[str, Any]
) -> Verdict | None:
    """A finite first loss with supervised labels: a multiple of the logits' cross-entropy (``TFD229``), else far
    above (``TFD222``) or below (``TFD223``) ln(V)."""
    observed, expected = init.observed, init.expected
    scaled = scaled_loss_verdict(observed, init.recomputed, expected, tolerance, counts, evidence)
    if scaled is not None:
        return scaled
    if observed > (1.0 + tolerance) * expected:
        return TFD222.verdict(evidence)
    if observed < (1.0 - tolerance) * expected:
        return _below_uniform(init, tolerance, evidence)
    return None


def output_kind_verdict(init: InitLoss, evidence: Mapping[str, Any]) -> Verdict | None:
    """``TFD220``: at least :data:`NORMALIZED_ROWS` of the sampled rows are probabilities; else ``TFD221`` (info):
    as many are log-probabilities."""
    if init.probabilities:
        return TFD220.verdict({**evidence, "probability_rows": init.probability_rows})
    if init.log_probability_rows >= NORMALIZED_ROWS:
        return TFD221.verdict({**evidence, "log_probability_rows": init.log_probability_rows})
    return None


def _divided_by_whole_number(observed: float, recomputed: float) -> bool:
    """Whether ``observed`` is ``recomputed / k`` for a whole number ``k`` from 2 to 1024, within 3%."""
    if not (observed > 0 and recomputed > observed):
        return False
    k = recomputed / observed
    return round(k) <= 1024 and abs(math.log(k / round(k))) <= 0.03


def _below_uniform(init: InitLoss, tolerance: float, evidence: Mapping[str, Any]) -> Verdict:
    """``TFD223``: the first loss far below ln(V): not the logits' V-way cross-entropy (warning); the logits' own,
    by predicting the current input token (a leak, warning); or the logits' own without copying (info: weights
    trained before)."""
    observed, expected, recomputed = init.observed, init.expected, init.recomputed
    # weights trained before: the shared reading of "has this model learned?" (functional/learning.py), on the
    # logits' own loss (the labels' unigram entropy is not counted yet at step 0)
    predicts = (
        bool(trained_before(recomputed, expected))
        and recomputed < (1.0 - tolerance) * expected
        and abs(observed - recomputed) <= tolerance * max(recomputed, 1e-6)
    )
    copying = (
        init.copy_rate is not None
        and (init.copy_rate >= 0.5 or init.kind == "encoder-decoder")  # a decoder input at t is never its label
        and init.copy_rate >= (init.repeat_rate or 0.0) + 0.25
        and not init.masked_lm
    )
    evidence = {**evidence, "copy_rate": init.copy_rate, "repeat_rate": init.repeat_rate}
    if predicts and not copying:
        return TFD223.verdict(
            {**evidence, "pretrained": True},
            hint=(
                "If this model was not trained before, its inputs show it the answer: look for labels that are not "
                "shifted with a causal mask missing, or the target copied into the input."
            ),
            severity="info",
            explanation=(
                f", and the logits' own cross-entropy ({recomputed:.3f}) agrees: the model already predicts its "
                "labels, as weights trained before (fine-tuning) do. Nothing to fix for a pretrained model"
            ),
        )
    if predicts:
        because = (
            f"the logits give it ({recomputed:.3f}) by predicting the current input token at {init.copy_rate:.0%} of "
            f"positions (the data repeats a token at {init.repeat_rate or 0.0:.0%}): the answer is in the input"
        )
    else:
        because = (
            f"the logits' own cross-entropy is {recomputed:.3f}: the returned loss is not the V-way cross-entropy of "
            "these logits"
        )
    return TFD223.verdict({**evidence, "pretrained": False}, explanation=f" before any update; {because}")


def batch_counts(
    supervised: float, label_rows: float, positions: float, accumulate_grad_batches: int, ranks: int
) -> dict[str, float]:
    """The counts a loss may be wrongly summed over or divided by, per rank (the inputs are over every rank)."""
    ranks = max(ranks, 1)
    return {
        "supervised tokens per batch": supervised / ranks,
        "sequences per batch": label_rows / ranks,
        "label positions per sequence": positions / max(label_rows, 1.0),
        "accumulate_grad_batches": float(accumulate_grad_batches),
        "ranks": float(ranks),
    }


def scaled_loss_verdict(
    observed: float,
    recomputed: float,
    expected: float,
    tolerance: float,
    counts: Mapping[str, float],
    evidence: Mapping[str, Any] | None = None,
) -> Verdict | None:
    """``TFD229``: the logits give ln(V) (within ``tolerance``) but the returned loss is a multiple of that: above by
    any factor, below only by one over a count in ``counts`` (NLLLoss on raw logits also lands below: ``TFD223``)."""
    if not (recomputed > 0 and abs(recomputed - expected) <= tolerance * expected):
        return None
    if (1.0 - tolerance) * expected <= observed <= (1.0 + tolerance) * expected:
        return None
    factor = observed / recomputed
    # the recomputed loss is a sample's mean, and the untrained per-token losses spread by a few percent
    close = {
        name: abs(math.log(abs(factor) * (n if factor < 1 else 1 / n)))
        for name, n in counts.items()
        if n >= 2 and factor != 0
    }
    matches = [(name, counts[name]) for _, name in sorted((d, name) for name, d in close.items() if d <= _COUNT_MATCH)]
    if factor < 1 and not matches:
        return None
    if matches:
        name, n = matches[0]
        if factor > 1:
            because = f", the number of {name} ({n:.0f}): the loss is summed over them, not averaged"
        else:
            because = f", one over the {name} ({n:.0f}): the loss is divided by it once too often"
    else:
        because = ", a factor that matches no count of the batch (an extra loss term or a multiplier)"
    return TFD229.verdict(
        {**(evidence or {}), "factor": factor, "matched_count": matches[0][0] if matches else None},
        returned=observed,
        logits_loss=recomputed,
        uniform=expected,
        because=because,
    )


# ---------------------------------------------------------------------------------------------------- the check
def check_findings(
    reading: CheckReading,
    step: int,
    run: LossRun,
    *,
    unigram_entropy: float | None,
    vocab: int,
    stall_tolerance: float,
    copy_threshold: float,
    learning_rates: Sequence[float] = (),
    shift_labels: bool = True,
) -> list[Verdict]:
    """Every finding of the check at ``step``: a stall or a copying model (:func:`check_verdicts`), bounded outputs
    (:func:`bounded_output_verdict`, unless step 0 found probabilities: ``TFD220``'s), the loss at the unigram entropy
    (:func:`context_verdict`) and the returned loss against the logits (:func:`loss_transform_verdict`). ``TFD233``
    drops ``TFD231`` and ``TFD232``: the loss does not train these logits."""
    window = run.window(step)
    unigram = unigram_entropy if unigram_entropy is not None else math.nan
    verdicts: list[Verdict | None] = list(
        check_verdicts(
            reading.loss,
            reading.expected,
            step,
            window=window,
            unigram_entropy=unigram,
            stall_tolerance=stall_tolerance,
            copy_rate=reading.copy_rate,
            repeat_rate=reading.repeat_rate,
            init_copy_rate=run.init_copy_rate,
            copy_threshold=copy_threshold,
            learning_rates=learning_rates,
            shift_labels=shift_labels,
        )
    )
    if not run.probabilities:
        verdicts.append(
            bounded_output_verdict(
                reading.recomputed,
                reading.floor,
                reading.logit_range,
                reading.expected,
                unigram,
                step,
                stall_tolerance=stall_tolerance,
                range_spread=reading.range_spread,
            )
        )
    verdicts.append(
        context_verdict(
            reading.own_loss,
            reading.rolled_loss,
            unigram,
            step,
            own_match=reading.own_match,
            rolled_match=reading.rolled_match,
            flat=flat_window(window, reading.loss, reading.expected, stall_tolerance),
            window_steps=step - min((s for s, _ in window), default=step),
            masked=run.masked_lm,
        )
    )
    transform = loss_transform_verdict(run.readings, vocab, unigram)
    if transform is not None and transform.code == TFD233.code:
        verdicts = [v for v in verdicts if v is None or v.code not in (TFD231.code, TFD232.code)]
    return [dataclasses.replace(v, step=step) for v in (*verdicts, transform) if v is not None]


def flat_window(window: Sequence[tuple[int, float]], loss: float, expected: float, tolerance: float) -> bool:
    """Whether the loss fell by less than ``tolerance`` of ln(V) from the highest finite point of ``window`` (True
    when there is none)."""
    earlier = [value for _, value in window if math.isfinite(value)]
    return not earlier or max(earlier) - loss <= tolerance * expected


def check_verdicts(
    loss: float,
    expected: float,
    step: int,
    *,
    stall_tolerance: float,
    window: Sequence[tuple[int, float]] = (),
    unigram_entropy: float = float("nan"),
    copy_rate: float = float("nan"),
    repeat_rate: float = float("nan"),
    init_copy_rate: float | None = None,
    copy_threshold: float = 0.5,
    learning_rates: Sequence[float] = (),
    shift_labels: bool = True,
) -> list[Verdict]:
    """The findings at the check: a loss within ``stall_tolerance`` of ln(V) and flat over ``window`` (``TFD225``,
    its message compared with the labels' ``unigram_entropy``); the model predicting its current input token more
    often than ``copy_threshold``, the data's repeat rate (by 0.25) and init (by :data:`COPY_RISE`) (``TFD226``)."""
    out: list[Verdict] = []
    flat = flat_window(window, loss, expected, stall_tolerance)
    if math.isfinite(loss) and abs(loss - expected) <= stall_tolerance * expected and flat:
        since = min((s for s, v in window if math.isfinite(v)), default=step)
        if math.isfinite(unigram_entropy) and unigram_entropy < (1.0 - stall_tolerance) * expected:
            what = (
                f"above the labels' unigram entropy ({unigram_entropy:.3f}, what learning the token frequencies alone "
                "gives): the model has not started to learn, not even the frequencies"
            )
        elif math.isfinite(unigram_entropy):
            what = (
                f"and the labels' unigram entropy ({unigram_entropy:.3f}) is itself near ln(V): the model has learned "
                "nothing beyond near-uniform frequencies"
            )
        else:
            what = "the loss of a uniform guess: the model has not started to learn"
        evidence = {
            "loss": loss,
            "expected_loss": expected,
            "step": step,
            "window_start": since,
            "unigram_entropy": unigram_entropy,
            "learning_rates": list(learning_rates)[:8],
        }
        out.append(TFD225.verdict(evidence, step=step, tolerance=stall_tolerance, what=what))
    init_rate = init_copy_rate if init_copy_rate is not None else 0.0
    if (
        copy_rate == copy_rate
        and copy_rate > copy_threshold
        and copy_rate >= repeat_rate + 0.25
        and copy_rate >= init_rate + COPY_RISE
    ):
        evidence = {
            "copy_rate": copy_rate,
            "repeat_rate": repeat_rate,
            "init_copy_rate": init_rate,
            "step": step,
            "shift_labels": shift_labels,
        }
        out.append(TFD226.verdict(evidence, step=step))
    return out


def bounded_output_verdict(
    loss: float,
    floor: float,
    logit_range: float,
    expected: float,
    unigram_entropy: float,
    step: int,
    *,
    stall_tolerance: float,
    range_spread: float = float("nan"),
) -> Verdict | None:
    """``TFD230``: the logits' own cross-entropy ``loss`` has left ln(V) and sits within :data:`FLOOR_PINNED` of the
    way from ``floor`` (the mean ``ln(1 + (V - 1) e^-w)`` of the rows' ranges ``w``) up to ln(V), the floor is
    :data:`FLOOR_ABOVE_DATA` of ln(V) above the unigram entropy, and the rows' ranges are alike (``range_spread`` at
    most :data:`RANGE_SPREAD`: a bound holds every row at the same width)."""
    if not (math.isfinite(loss) and math.isfinite(floor) and math.isfinite(unigram_entropy)):
        return None
    if loss > (1.0 - stall_tolerance) * expected or floor < unigram_entropy + FLOOR_ABOVE_DATA * expected:
        return None
    if loss - floor > FLOOR_PINNED * (expected - floor) or range_spread > RANGE_SPREAD:
        return None
    evidence = {
        "loss": loss,
        "floor": floor,
        "logit_range": logit_range,
        "expected_loss": expected,
        "unigram_entropy": unigram_entropy,
        "range_spread": range_spread,
        "step": step,
    }
    return TFD230.verdict(evidence, step=step, classes=round(math.exp(expected)))


def context_verdict(
    loss: float,
    rolled_loss: float,
    unigram_entropy: float,
    step: int,
    *,
    own_match: float = float("nan"),
    rolled_match: float = float("nan"),
    flat: bool = True,
    window_steps: int = STALL_STEPS,
    masked: bool = False,
) -> Verdict | None:
    """``TFD231`` / ``TFD232``: the loss sits at the labels' unigram entropy and the model predicts its own sample's
    labels no better than its neighbour's (``rolled_loss``). What the labels repeat (``own_match`` /
    ``rolled_match``, masked LM: whose masks they sit on) tells which side is at fault: the neighbour's inputs, or
    neither, ``TFD231`` (labels from other samples); their own, ``TFD232`` (the model ignores its context), once the
    loss is ``flat`` over :data:`STALL_STEPS` steps (``window_steps``).
    """
    if not (math.isfinite(loss) and math.isfinite(rolled_loss) and math.isfinite(unigram_entropy)):
        return None
    low, high = UNIGRAM_BAND
    if not (low * unigram_entropy <= loss <= high * unigram_entropy):
        return None
    gap = rolled_loss - loss
    if gap > CONTEXT_GAP * loss:
        return None
    evidence = {
        "loss": loss,
        "rolled_loss": rolled_loss,
        "unigram_entropy": unigram_entropy,
        "own_match": own_match,
        "rolled_match": rolled_match,
        "step": step,
        "window_steps": window_steps,
    }
    measured = math.isfinite(own_match) and math.isfinite(rolled_match)
    if measured and own_match >= 0.5 and own_match >= rolled_match + RELATION_MARGIN:
        if not flat or window_steps < STALL_STEPS:
            return None
        return _ignores_context(evidence, own_match, rolled_match, masked)
    if measured and rolled_match >= 0.5 and rolled_match >= own_match + RELATION_MARGIN:
        why = (
            f"the labels repeat the *neighbouring* sample's inputs ({rolled_match:.0%} of positions, their own only "
            f"{own_match:.0%}): the labels are joined to the inputs off by one row"
        )
    elif measured:
        why = (
            f"the labels repeat neither their own inputs ({own_match:.0%} of positions) nor a neighbour's "
            f"({rolled_match:.0%}): they come from other samples (a shuffled label column), unless this task's labels "
            "never repeat their inputs (classification, translation), in which case the model ignores its inputs"
        )
    else:
        # unmeasured (an encoder-decoder's labels enter only its decoder): a model still on the unigram plateau, as a
        # healthy encoder-decoder is while its cross-attention forms, reads the same, so no warning is earned
        why = (
            "the labels do not depend on the inputs (they belong to other samples), or the model ignores its inputs; "
            "with no token inputs shaped like the labels this cannot be told apart here"
        )
        return TFD231.verdict(evidence, severity="info", step=step, why=why)
    return TFD231.verdict(evidence, step=step, why=why)


def _ignores_context(evidence: Mapping[str, Any], own_match: float, rolled_match: float, masked: bool) -> Verdict:
    """``TFD232``: the labels repeat their own inputs (masked LM: sit on their own inputs' masks), so they are right
    and the model ignores its context; info for masked-LM labels (their plateau)."""
    if masked:
        # the masked-LM plateau: these objectives sit at the unigram entropy before they learn to read the context,
        # for longer the lower the learning rate; at one check that is no evidence of a fault
        return TFD232.verdict(
            evidence,
            severity="info",
            step=evidence["step"],
            relation=(
                f"sit where their own inputs hold the mask token ({own_match:.0%} of positions, the neighbour's "
                f"{rolled_match:.0%})"
            ),
            conclusion=(
                "the model does not use its context yet. Masked-LM objectives sit at this level (their plateau) before "
                "they learn to, the longer the lower the learning rate; if it lasts, the model cannot see its inputs"
            ),
        )
    return TFD232.verdict(
        evidence,
        step=evidence["step"],
        relation=f"repeat their own inputs ({own_match:.0%} of positions)",
        conclusion="the model ignores its context",
    )


# ------------------------------------------------------------------------------- the returned loss against the logits
@dataclass(frozen=True)
class LossReading:
    """One compared step: the loss ``training_step`` returned and what the recorded logits give (host floats)."""

    step: int
    loss: float  # the returned loss (averaged over ranks, undivided by Lightning's accumulation)
    ce: float  # the logits' own cross-entropy (sampled rows)
    ce_error: float  # standard error of ``ce`` as a sample's mean (0 when every row was taken)
    uniform: float  # the logits' cross-entropy against a uniform target
    logit_range: float  # mean over rows of max - min
    beta_ce: tuple[float, ...]  # cross-entropy of b * logits for b in TEMPERATURE_GRID
    supervised_share: float = float("nan")  # supervised label positions over all of them, in the whole batch
    cap_ce: tuple[float, ...] = ()  # cross-entropy of c * tanh(logits / c) for c in CAP_GRID

    def to_list(self) -> list[Any]:
        return [list(v) if isinstance(v, tuple) else v for v in dataclasses.astuple(self)]

    @classmethod
    def from_list(cls, value: Sequence[Any]) -> LossReading:
        step, loss, ce, error, uniform, logit_range, betas, *rest = value
        numbers = (float(v) for v in (loss, ce, error, uniform, logit_range))
        share = float(rest[0]) if rest else math.nan
        caps = tuple(float(c) for c in rest[1]) if len(rest) > 1 else ()
        return cls(int(step), *numbers, tuple(float(b) for b in betas), share, caps)

    @property
    def best(self) -> float:
        """The lowest cross-entropy of the logits at any temperature of the grid."""
        return min((v for v in self.beta_ce if math.isfinite(v)), default=self.ce)

    def temperatures(self) -> list[float]:
        """The multipliers ``b`` (``1/T``) at which the logits' cross-entropy equals the returned loss, interpolated
        in ``ln b`` between the grid's points (a convex curve in ``b``: at most two)."""
        return _roots(TEMPERATURE_GRID, self.beta_ce, self.loss)


def _roots(grid: Sequence[float], values: Sequence[float], target: float) -> list[float]:
    """Where the curve ``values`` over ``grid`` crosses ``target``, interpolated in the grid's logarithm."""
    out: list[float] = []
    for k in range(len(values) - 1):
        a, b = values[k] - target, values[k + 1] - target
        if not (math.isfinite(a) and math.isfinite(b)) or a * b > 0 or a == b:
            continue
        lo, hi = math.log(grid[k]), math.log(grid[k + 1])
        root = math.exp(lo + a / (a - b) * (hi - lo))
        if not out or abs(math.log(root / out[-1])) > 1e-6:
            out.append(root)
    return out


def _at(grid: Sequence[float], values: Sequence[float], x: float) -> float:
    """The curve ``values`` over ``grid`` at ``x``, interpolated in the grid's logarithm (nan outside the grid)."""
    for k in range(len(values) - 1):
        if grid[k] <= x <= grid[k + 1]:
            t = math.log(x / grid[k]) / math.log(grid[k + 1] / grid[k])
            return values[k] + t * (values[k + 1] - values[k])
    return math.nan


def loss_reading(host: Mapping[str, float], loss: float, step: int) -> LossReading | None:
    """:class:`LossReading` from the reduced sums of :func:`~lightning_tfdebug.functional.loss.loss_transform_sums`;
    None when no row was supervised or no loss was returned."""
    n, total = host.get("tx_count", 0.0), host.get("tx_total", 0.0)
    if not n or not math.isfinite(loss):
        return None
    ce = host["tx_ce_sum"] / n
    variance = max(host["tx_ce_sq_sum"] / n - ce**2, 0.0)
    sampled = max(1.0 - n / total, 0.0) if total else 0.0  # finite population: no error when every row was taken
    return LossReading(
        step=step,
        loss=loss,
        ce=ce,
        ce_error=math.sqrt(variance / n * sampled),
        uniform=host["tx_uniform_sum"] / n,
        logit_range=host["tx_range_sum"] / n,
        beta_ce=tuple(host[f"tx_beta_{k}"] / n for k in range(len(TEMPERATURE_GRID))),
        supervised_share=total / host["tx_positions"] if host.get("tx_positions") else float("nan"),
        cap_ce=tuple(host[f"tx_cap_{k}"] / n for k in range(len(CAP_GRID))) if "tx_cap_0" in host else (),
    )


def bound_width(loss: float, vocab: int) -> float:
    """The range width ``w`` whose floor ``ln(1 + (V - 1) e^-w)`` equals ``loss`` (below ln(V))."""
    return math.log((vocab - 1) / math.expm1(loss)) if 0 < loss < math.log(vocab) else float("nan")


def loss_transform_verdict(
    readings: Sequence[LossReading], vocab: int, unigram_entropy: float = float("nan")
) -> Verdict | None:
    """``TFD233``-``TFD235``: the returned loss disagrees with the recorded logits' cross-entropy at every compared
    step (at least two), and what explains it. First match wins:

    * it agrees at some step (:data:`AGREE`, or three standard errors of a sampled mean): nothing, unless one
      temperature gives the loss at every step (a model compensating a temperature crosses it on the way);
    * the loss is pinned at the floor of a bound (:func:`_pinned`): ``TFD233``, naming the bound's width ``w``;
    * label smoothing (:data:`SMOOTHING_SPREAD`): nothing;
    * a soft-cap ``c * tanh(logits / c)`` fits every step better than any temperature (:func:`_soft_cap`):
      ``TFD233`` when its floor keeps every token below probability 1/2 or above what the logits reach, else nothing;
    * a temperature (:data:`TEMPERATURE_MATCH`, :data:`TEMPERATURE_MIN`): ``TFD234`` (info);
    * the loss far above the logits' cross-entropy at every step (:func:`_far_above`) and not falling with it
      (:func:`_follows`: a large added term does): ``TFD233``;
    * a constant factor (:data:`SCALE_SPREAD`) or a small added term (:data:`ADDED_TERM`): nothing;
    * else ``TFD235`` (info) with both numbers.
    """
    points = [r for r in readings if math.isfinite(r.loss) and math.isfinite(r.ce) and r.ce > 0]
    if len(points) < 2:
        return None
    agreeing = [abs(r.loss - r.ce) <= max(AGREE * r.ce, 3.0 * r.ce_error) for r in points]
    if all(agreeing):
        return None  # the loss is the logits' cross-entropy
    first, last = points[0], points[-1]
    expected = uniform_loss(vocab)
    evidence: dict[str, Any] = {
        "steps": [r.step for r in points],
        "returned_loss": [r.loss for r in points],
        "logits_loss": [r.ce for r in points],
        "best_temperature_loss": [r.best for r in points],
        "logit_range": [r.logit_range for r in points],
        "expected_loss": expected,
        "unigram_entropy": unigram_entropy,
    }
    head = {
        "first_step": first.step,
        "last_step": last.step,
        "returned": _series(r.loss for r in points),
        "logits_ce": _series(r.ce for r in points),
        "last_loss": last.loss,
        "last_ce": last.ce,
    }
    pinned = not any(agreeing) and _pinned(points, expected, unigram_entropy)
    if not pinned and _label_smoothing(points):
        return None  # label smoothing: healthy
    cap = None if pinned else _soft_cap(points)  # agreeing at a step too: a small cap barely moves small logits
    if cap is not None:  # c * tanh(logits / c) gives the loss, better than any temperature does
        return _capped(cap, vocab, last, evidence, head)
    shared = None if pinned else _shared_temperature(points)  # a model compensating T crosses CE(logits / T)
    if shared is not None and abs(math.log(shared)) >= TEMPERATURE_MIN:
        temperature = 1.0 / shared
        direction = "sharper" if temperature > 1 else "flatter"
        return TFD234.verdict(
            {**evidence, "temperature": temperature}, severity="info", step=last.step, direction=direction, **head
        )
    if pinned or (all(_far_above(r, expected) for r in points) and not _follows(points)):
        detail = ""
        if pinned:  # the width whose floor the loss sits on
            evidence.update(width=bound_width(last.loss, vocab), floor=last.loss)
            data = f", above the labels' unigram entropy ({unigram_entropy:.3f})" if unigram_entropy > 0 else ""
            detail = (
                f"; it stays at the floor ln(1 + (V-1) e^-w) of outputs confined to a range of width w = "
                f"{evidence['width']:.2f} (V={vocab}){data}, while the logits reach {last.best:.3f} and their range "
                f"keeps growing ({first.logit_range:.3g} -> {last.logit_range:.3g})"
            )
        return TFD233.verdict(evidence, step=last.step, gap=last.loss - last.ce, detail=detail, **head)
    if any(agreeing) or _explained_difference(points):
        return None
    return TFD235.verdict(evidence, severity="info", step=last.step, **head)


def _capped(
    cap: tuple[tuple[float, float], float],
    vocab: int,
    last: LossReading,
    evidence: dict[str, Any],
    head: dict[str, Any],
) -> Verdict | None:
    """``TFD233`` for the soft-cap :func:`_soft_cap` found, when it binds; None when it binds neither the logits nor
    a prediction of probability 1/2."""
    (c, miss), temperature_miss = cap
    floor = math.log1p((vocab - 1) * math.exp(-2.0 * c))
    if floor <= min(math.log(2.0), last.best):
        return None  # a soft-cap that binds neither the logits nor a prediction of probability 1/2
    evidence.update(cap=c, cap_miss=miss, temperature_miss=temperature_miss, width=2.0 * c, floor=floor)
    detail = (
        f"; it is the cross-entropy of c * tanh(logits / c) with c = {c:.3g} at every compared step (largest "
        f"miss {miss:.2%} of the loss, {temperature_miss:.2%} for the best single temperature), and outputs "
        f"confined to [-c, c] cannot bring the loss below ln(1 + (V-1) e^-2c) = {floor:.3f} (V={vocab}): no token "
        f"can get more than {1.0 / (1.0 + (vocab - 1) * math.exp(-2.0 * c)):.1%} of the probability, while the "
        f"logits already reach {last.best:.3f}"
    )
    return TFD233.verdict(evidence, step=last.step, gap=last.loss - last.ce, detail=detail, **head)


def _pinned(points: Sequence[LossReading], expected: float, unigram_entropy: float) -> bool:
    """A bound pins the returned loss: above the logits' cross-entropy at every point, it fell by at most
    :data:`PINNED_FALL` of itself or by less than :data:`LOSS_FOLLOWS` of the logits' cross-entropy's fall, stays
    :data:`PINNED_GAP` of ln(V) above the logits' best loss at any temperature and (when known)
    :data:`FLOOR_ABOVE_DATA` of ln(V) above the labels' unigram entropy, below ln(V), while the logits' range grew by
    :data:`RANGE_GROWTH`."""
    first, last = points[0], points[-1]
    above_data = not math.isfinite(unigram_entropy) or last.loss >= unigram_entropy + FLOOR_ABOVE_DATA * expected
    fell = first.loss - last.loss
    return (
        all(r.loss > r.ce for r in points)
        and (fell <= PINNED_FALL * last.loss or fell < LOSS_FOLLOWS * (first.ce - last.ce))
        and all(r.loss - r.best >= PINNED_GAP * expected for r in points)
        and last.logit_range >= (1.0 + RANGE_GROWTH) * first.logit_range
        and above_data
        and last.loss < expected
    )


def _soft_cap(points: Sequence[LossReading]) -> tuple[tuple[float, float], float] | None:
    """``((c, miss), temperature_miss)``: the soft-cap ``c`` whose ``c * tanh(logits / c)`` gives the returned loss at
    every point within :data:`AGREE` of it (``miss``: the largest relative miss), strictly better than the best single
    temperature does (``temperature_miss``, inf when none crosses the loss); None when none does. A temperature and
    a bound both raise the loss above the logits' cross-entropy; only the bound saturates, so the shape of the two
    curves, not one number, tells them apart."""
    if not all(r.cap_ce for r in points):
        return None
    cap = _shared_fit(points, CAP_GRID, lambda r: r.cap_ce)
    if cap is None or cap[1] > AGREE:
        return None
    temperature = _shared_fit(points, TEMPERATURE_GRID, lambda r: r.beta_ce)
    temperature_miss = math.inf if temperature is None else temperature[1]
    return (cap, temperature_miss) if cap[1] < temperature_miss else None


def _shared_fit(points: Sequence[LossReading], grid: Sequence[float], curve: Any) -> tuple[float, float] | None:
    """The one parameter on ``grid`` whose curve (``curve(reading)``) gives the returned loss at every point most
    closely, and its largest relative miss; tried at every point's crossings and between neighbouring ones."""
    roots = sorted(root for r in points for root in _roots(grid, curve(r), r.loss))
    candidates = roots + [math.sqrt(a * b) for a, b in itertools.pairwise(roots)]
    best: tuple[float, float] | None = None
    for x in candidates:
        miss = max(abs(_at(grid, curve(r), x) - r.loss) / r.loss for r in points)
        if math.isfinite(miss) and (best is None or miss < best[1]):
            best = (x, miss)
    return best


def _far_above(r: LossReading, expected: float) -> bool:
    """The loss is above the logits' cross-entropy by more than an added term explains: :data:`ADDED_TERM` of it,
    :data:`FAR_ABOVE` of ln(V) and three standard errors of a sampled mean."""
    return r.loss - r.ce > max(ADDED_TERM * r.ce, FAR_ABOVE * expected, 3.0 * r.ce_error)


def _follows(points: Sequence[LossReading]) -> bool:
    """The returned loss fell by at least :data:`ADDED_FOLLOWS` of what the logits' own cross-entropy fell (which fell
    by at least :data:`AGREE` of itself): a term added beside the cross-entropy (distillation, an auxiliary loss) trains
    with it, while a bound or squash keeps the loss from following the logits (0.18 to 0.6 of their fall measured)."""
    first, last = points[0], points[-1]
    ce_fall = first.ce - last.ce
    return ce_fall >= AGREE * first.ce and first.loss - last.loss >= ADDED_FOLLOWS * ce_fall


def _label_smoothing(points: Sequence[LossReading]) -> bool:
    """The same smoothing ``e = (loss - ce) / (uniform - ce)`` at every point, within :data:`SMOOTHING_SPREAD`."""
    eps = [(r.loss - r.ce) / (r.uniform - r.ce) for r in points if r.uniform > r.ce]
    if not (len(eps) == len(points) and min(eps) > 0 and max(eps) <= MAX_SMOOTHING):
        return False
    low, rel = SMOOTHING_SPREAD
    return max(eps) - min(eps) <= max(low, rel * sum(eps) / len(eps))


def _explained_difference(points: Sequence[LossReading]) -> bool:
    """A constant factor (``loss / k`` for manual accumulation), a sum over the supervised tokens divided by every
    label position (padding included), or a small added term (z-loss, auxiliary loss)."""
    ratios = [r.loss / r.ce for r in points]
    if min(ratios) <= 0:
        return False
    if math.log(max(ratios) / min(ratios)) <= SCALE_SPREAD:
        return True
    if all(abs(math.log(q / r.supervised_share)) <= SCALE_SPREAD for q, r in zip(ratios, points)):
        return True
    return all(0 < r.loss - r.ce <= ADDED_TERM * r.ce for r in points)


def _series(values: Any) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _shared_temperature(points: Sequence[LossReading]) -> float | None:
    """The multiplier ``b`` that gives the returned loss at every point within :data:`TEMPERATURE_MATCH`, or None."""
    roots = [r.temperatures() for r in points]
    if not all(roots):
        return None
    for candidate in roots[0]:
        matched = [min(rs, key=lambda b: abs(math.log(b / candidate))) for rs in roots]
        if all(abs(math.log(b / candidate)) <= TEMPERATURE_MATCH for b in matched):
            return math.exp(sum(math.log(b) for b in matched) / len(matched))
    return None
