"""LossAtInit's decisions at step 0, without a Trainer: the outputs' kind (``TFD220``, ``TFD221``), no supervised
label (``TFD224``), a loss that is not finite (``TFD227``), the logits or labels not found (``TFD228``), a loss that
is a multiple of the logits' own (``TFD229``), far above (``TFD222``) or below (``TFD223``) ln(V)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from lightning_tfdebug.callbacks.loss_at_init.readings import NORMALIZED_ROWS, InitLoss
from lightning_tfdebug.functional.evidence_chart import TRAINING_LOSS, EvidenceChart
from lightning_tfdebug.functional.learning import trained_before
from lightning_tfdebug.functional.verdicts import Rule, Verdict

TFD228 = Rule(
    "TFD228",
    "info",
    "LossAtInit",
    title="logits or labels cannot be found; names the argument to set, then stands aside",
    trigger="the logits or labels cannot be found; LossAtInit names the argument to set and stands aside",
    details=(
        "Emitted once, then LossAtInit stands aside for the run: no labels found in the batch (`labels_key` unset and"
        " none of `labels`, `label_ids`, `targets`, `target`, `tgt`, `y`, `label` or a tuple's last item, or a guess "
        "whose shape does not fit the logits), no logits found (`logits_module` unset and neither the "
        'LightningModule\'s `forward`, a direct child returning `.logits`/`"logits"`, nor a child returning a tensor '
        "shaped like the labels plus a class dimension wider than every label id), or floating-point labels (soft, "
        "multi-label or regression targets: ln(V) is the yardstick of a V-way cross-entropy over class indices only)."
        " The message lists the batch's keys and the model's direct children and names the argument to set."
    ),
    hint="Set the named argument; LossAtInit does nothing else in this run.",
    reason="The check stands aside and names the argument that would let it run; nothing was measured",
    message="LossAtInit cannot read the model's outputs or labels: {reason}.",
)


def unreadable_verdict(reason: str, labels_key: Any, logits_module: str | None, step: int | None = None) -> Verdict:
    """``TFD228``: the logits or labels cannot be found; ``reason`` names the argument to set."""
    return TFD228.verdict({"labels_key": labels_key, "logits_module": logits_module}, step=step, reason=reason)


TFD224 = Rule(
    "TFD224",
    "error",
    "LossAtInit",
    title="no supervised tokens: every label is `ignore_index`",
    headline="no supervised tokens: every label is ignore_index ({ignore_index})",
    trigger=("no label of the first batch is supervised (all `ignore_index` after alignment): the loss is NaN or 0"),
    details=(
        "At step 0 (the first micro-batch, before any update): no label position is supervised after alignment, every"
        " label is `ignore_index` (default -100) or, with `shift_labels` (default true), only the first position is "
        "not. Decided before every other step-0 loss finding."
    ),
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


TFD227 = Rule(
    "TFD227",
    "error",
    "LossAtInit",
    title="the step-0 loss is not finite although labels are supervised",
    headline="the step-0 loss is not finite ({observed_loss}) although labels are supervised",
    trigger="the step-0 loss is NaN/inf although labels are supervised",
    details=(
        "At step 0, with at least one supervised label: the loss `training_step` returned (mean over ranks) is NaN or"
        " infinite. Decided before the loss is compared with ln(V)."
    ),
    hint=(
        "Look for log(0), division by zero or an overflow in the forward or the loss; NaNFirstFrame names the "
        "first module that produced a non-finite value."
    ),
    reason="A loss that is not finite before any update turns the first step's weights into NaN",
    message="The loss of the first step is {observed_loss}, before any update.",
)


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
    # The order between step 0's codes, in this one place: with no supervised label (TFD224) the loss is 0/0, and a
    # loss that is not finite (TFD227) has no scale to judge, so each ends the list; probabilities (TFD220) already
    # explain a loss at ln(V); TFD229 (a multiple of the logits' own loss) goes before TFD222/TFD223, which would
    # otherwise blame the logits for a loss the reduction scaled (see _loss_scale_verdict).
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


TFD220 = Rule(
    "TFD220",
    "error",
    "LossAtInit",
    title="the outputs are probabilities: softmax before a loss that applies it again (loss stuck at ln(V))",
    headline="the outputs are probabilities: softmax before the loss (loss stuck near ln V = {expected_loss:.3f})",
    chart=EvidenceChart("Is the loss stuck at ln V?", "nats", logged=(TRAINING_LOSS,), lines=("expected_loss",)),
    trigger=(
        "at step 0, >= 99% of the sampled output rows are non-negative and sum to 1: `forward` returns "
        "probabilities (a cross-entropy then applies softmax again and the loss sits at ln(V))"
    ),
    details=(
        "At step 0, on at most `max_rows` (default 2048) sampled rows of the logits (cast to float32): at least 99% "
        "of the rows are non-negative and sum to 1 within 1e-2. V is the logits' last dimension unless `vocab_size` "
        "is given. When it fires, the step-0 loss is not judged further (TFD222, TFD223, TFD229) and the floor check "
        "TFD236 does not read the model's forward."
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
    details=(
        "At step 0, when the rows are not probabilities (`TFD220`): at least 99% of the sampled rows (at most "
        "`max_rows`, default 2048) are log-probabilities, every value <= 0 and logsumexp 0 within 1e-2. Info: right "
        "for NLLLoss, harmless for cross_entropy."
    ),
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


def output_kind_verdict(init: InitLoss, evidence: Mapping[str, Any]) -> Verdict | None:
    """``TFD220``: at least :data:`NORMALIZED_ROWS` of the sampled rows are probabilities; else ``TFD221`` (info):
    as many are log-probabilities."""
    if init.probabilities:
        return TFD220.verdict({**evidence, "probability_rows": init.probability_rows})
    if init.log_probability_rows >= NORMALIZED_ROWS:
        return TFD221.verdict({**evidence, "log_probability_rows": init.log_probability_rows})
    return None


TFD222 = Rule(
    "TFD222",
    "warning",
    "LossAtInit",
    title="the step-0 loss far above ln(V): logits too large at init",
    headline="step-0 loss {observed_loss:.3f} far above ln V = {expected_loss:.3f}: logits too large at init",
    chart=EvidenceChart(
        "Where does the loss start against ln V?",
        "nats",
        logged=("loss_at_init/loss",),
        lines=("expected_loss", "observed_loss"),
    ),
    trigger="the step-0 loss is above `(1 + init_tolerance) ln(V)`",
    details=(
        "At step 0, with supervised labels, a finite loss and outputs that are not probabilities: the returned loss "
        "(undivided by gradient accumulation, mean over ranks) is above `(1 + init_tolerance) ln(V)` "
        "(`init_tolerance` default 0.25, so +25%), and `TFD229` does not explain it (the logits' own cross-entropy is"
        " not within `init_tolerance` of ln(V)). Skipped under manual optimization when the loss is the logits' "
        "cross-entropy divided by a whole number 2 to 1024 (within 3%)."
    ),
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


def _divided_by_whole_number(observed: float, recomputed: float) -> bool:
    """Whether ``observed`` is ``recomputed / k`` for a whole number ``k`` from 2 to 1024, within 3%."""
    if not (observed > 0 and recomputed > observed):
        return False
    k = recomputed / observed
    return round(k) <= 1024 and abs(math.log(k / round(k))) <= 0.03


TFD223 = Rule(
    "TFD223",
    "warning",
    "LossAtInit",
    title=(
        "the step-0 loss far below ln(V): the loss is not the logits' V-way cross-entropy, or the target leaks "
        "into the input (info for a pretrained model)"
    ),
    headline="step-0 loss {observed_loss:.3f} far below ln V = {expected_loss:.3f}",
    chart=EvidenceChart(
        "Where does the loss start against ln V?",
        "nats",
        logged=("loss_at_init/loss",),
        lines=("expected_loss", "observed_loss"),
    ),
    trigger=(
        "the step-0 loss is below `(1 - init_tolerance) ln(V)` and the logits' own cross-entropy is not, or the "
        "logits reach it by predicting the current input token; info when the logits give that loss themselves "
        "without copying (weights trained before: fine-tuning)"
    ),
    details=(
        "At step 0, as `TFD222` but the returned loss is below `(1 - init_tolerance) ln(V)` (default 0.75 ln(V)) and "
        "`TFD229` does not explain it. Info (weights trained before, a fine-tune) when the logits' own cross-entropy "
        "is also below that band, agrees with the returned loss within `init_tolerance` of itself, and has made the "
        "shared 'trained before' progress from ln(V), unless the logits reach it by copying: the argmax equals the "
        "current input token (read via `input_key`) at 50% of positions or more (any rate for an encoder-decoder's "
        "decoder input) and 0.25 above the data's own repeat rate `inputs[t] == inputs[t+1]` (not for masked-LM "
        "labels). A warning otherwise: the loss is not the logits' V-way cross-entropy (NLLLoss on raw logits, a "
        "wrong `vocab_size`, padding averaged in), or the answer is in the input."
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


_COUNT_MATCH = math.log(1.15)
"""A loss factor within 15% of a count of the batch names it."""


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


TFD229 = Rule(
    "TFD229",
    "warning",
    "LossAtInit",
    title="the returned loss is a multiple of its logits' cross-entropy (summed, or divided twice)",
    headline="the returned loss {returned:.4g} is {factor:.4g}x the logits' cross-entropy {logits_loss:.4g}",
    trigger=(
        "the step-0 logits give a cross-entropy within `init_tolerance` of ln(V) but the returned loss is outside"
        " that band: above by any factor, below by one over a count of the batch (rows, tokens, accumulation, "
        "ranks)"
    ),
    details=(
        "At step 0: the cross-entropy recomputed from the captured logits is within `init_tolerance` (default 0.25) "
        "of ln(V) while the returned loss is outside `(1 ± init_tolerance) ln(V)`. Above: any factor fires. Below: "
        "only a factor within 15% of one over a count of the batch (per rank: supervised tokens, sequences, label "
        "positions per sequence, `accumulate_grad_batches`, the number of ranks; counts of at least 2); a factor "
        "below one that matches none stays `TFD223`. The message names the count within 15% of the factor, if any. "
        "Decided before `TFD222`/`TFD223`, which it replaces."
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


RULES: tuple[Rule, ...] = (TFD220, TFD221, TFD222, TFD223, TFD224, TFD227, TFD228, TFD229)
"""The rules decided in this module, in code order."""

BLOCK = ("TFD220", "TFD239")
"""The codes reserved for LossAtInit's rules (every one of its rule modules declares the same)."""
