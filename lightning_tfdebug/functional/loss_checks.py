"""LossAtInit's decisions, without a Trainer: what the first loss and the model's outputs say about the loss wiring
(``TFD220``-``TFD224``, ``TFD227``, ``TFD229``), and whether training has left ln(V) or learned to copy its input
(``TFD225``, ``TFD226``).

The inputs are host floats: the sums and counts of :func:`~lightning_tfdebug.functional.loss.init_loss_sums` and
:func:`~lightning_tfdebug.functional.loss.copy_sums`, added over ranks and moved to the host once by the callback.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_tfdebug.functional.loss import uniform_loss
from lightning_tfdebug.functional.verdicts import Verdict

COPY_RISE = 0.1
"""TFD226 needs the copy rate to have risen by this much since init (tied embeddings copy from the start)."""
NORMALIZED_ROWS = 0.99
"""Fraction of sampled rows that must be probabilities (or log-probabilities) for TFD220 (TFD221)."""
_COUNT_MATCH = math.log(1.15)
"""A loss factor within 15% of a count of the batch names it (the counts are far apart: rows, length, tokens)."""


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


def _mean(total: float, count: float, default: float = float("nan")) -> float:
    return total / count if count else default


def summarize_init(host: Mapping[str, float], vocab: int) -> InitLoss:
    """:class:`InitLoss` from the reduced ``init_loss_sums`` and ``copy_sums`` plus ``loss_sum`` / ``loss_n`` (the
    returned loss summed over the ranks that have one)."""
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
    )


def classify_init_loss(
    init: InitLoss,
    *,
    init_tolerance: float,
    ignore_index: int,
    shifted: bool,
    accumulate_grad_batches: int = 1,
    ranks: int = 1,
) -> list[Verdict]:
    """The findings of the first loss, in the order they are decided.

    Outputs that are probabilities (``TFD220``) or log-probabilities (``TFD221``, info); then, first match wins: no
    supervised label (``TFD224``), a loss that is not finite (``TFD227``), probabilities (nothing more to say), a loss
    that is a multiple of the logits' own cross-entropy (``TFD229``, :func:`scaled_loss_verdict`), a loss far above
    (``TFD222``) or below (``TFD223``) ln(V) by more than ``init_tolerance``.
    """
    out: list[Verdict] = []
    observed, expected, vocab = init.observed, init.expected, init.vocab
    evidence: dict[str, Any] = {
        "observed_loss": observed,
        "expected_loss": expected,
        "vocab_size": vocab,
        "recomputed_loss": init.recomputed,
        "logit_std": init.logit_std,
        "shift_labels": shifted,
    }
    probabilities = init.probability_rows >= NORMALIZED_ROWS
    if probabilities:
        out.append(
            Verdict(
                "TFD220",
                f"The model's outputs are already probabilities: {init.probability_rows:.0%} of the sampled rows are "
                "non-negative and sum to 1. A loss that applies softmax again (cross_entropy) sees a nearly uniform "
                f"distribution and stays at ln(V) = {expected:.3f}.",
                {**evidence, "probability_rows": init.probability_rows},
            )
        )
    elif init.log_probability_rows >= NORMALIZED_ROWS:
        out.append(
            Verdict(
                "TFD221",
                f"The model's outputs are log-probabilities ({init.log_probability_rows:.0%} of the sampled rows have "
                "logsumexp 0). That is right for NLLLoss and harmless for cross_entropy (log_softmax is idempotent).",
                {**evidence, "log_probability_rows": init.log_probability_rows},
            )
        )
    if init.supervised == 0:
        out.append(
            Verdict(
                "TFD224",
                f"No supervised tokens: every label of the first batch is ignore_index ({ignore_index}), so the loss "
                f"is {observed:.4g} (NaN or 0) and nothing is learned.",
                {**evidence, "label_positions": init.positions, "supervised": 0},
            )
        )
        return out
    if not math.isfinite(observed):
        out.append(Verdict("TFD227", f"The loss of the first step is {observed}, before any update.", evidence))
        return out
    if probabilities:
        return out  # the loss value says nothing more about the wiring
    counts = batch_counts(init.supervised, init.label_rows, init.positions, accumulate_grad_batches, ranks)
    scaled = scaled_loss_verdict(observed, init.recomputed, expected, init_tolerance, counts, evidence)
    if scaled is not None:
        out.append(scaled)
    elif observed > (1.0 + init_tolerance) * expected:
        out.append(
            Verdict(
                "TFD222",
                f"The initial loss {observed:.3f} is far above ln(V) = {expected:.3f} (V={vocab}): the untrained "
                f"model is confidently wrong (logit spread {init.logit_std:.3g}).",
                evidence,
            )
        )
    elif observed < (1.0 - init_tolerance) * expected:
        out.append(
            Verdict(
                "TFD223",
                f"The initial loss {observed:.3f} is far below ln(V) = {expected:.3f} (V={vocab}) before any "
                "training: the model can see the answer, or the loss is not a cross-entropy over V classes.",
                evidence,
            )
        )
    return out


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
    """``TFD229``: the logits give ln(V) but the returned loss is a multiple of that.

    The untrained logits are near uniform (their cross-entropy is within ``tolerance`` of ln(V)), so a returned loss
    far from ln(V) is not the logits' fault: the loss is scaled. Above, any factor is reported (a sum instead of a
    mean, a multiplied or dominating extra term); below, only a factor that is one over a count in ``counts`` (rows,
    tokens, accumulation, ranks), since NLLLoss on raw logits also lands below ln(V) and is ``TFD223``'s.
    """
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
    return Verdict(
        "TFD229",
        f"The loss training_step returned ({observed:.4g}) is {factor:.4g}x the mean cross-entropy of the model's own "
        f"logits ({recomputed:.4g}, at ln(V) = {expected:.3f} as an untrained model should be){because}. The logits "
        "are fine; the loss is scaled, and with it the gradients.",
        {**(evidence or {}), "factor": factor, "matched_count": matches[0][0] if matches else None},
    )


def check_verdicts(
    loss: float,
    expected: float,
    step: int,
    *,
    stall_tolerance: float,
    copy_rate: float = float("nan"),
    repeat_rate: float = float("nan"),
    init_copy_rate: float | None = None,
    copy_threshold: float = 0.5,
    learning_rates: Sequence[float] = (),
    shift_labels: bool = True,
) -> list[Verdict]:
    """The findings at ``check_step``: the loss still within ``stall_tolerance`` of ln(V) (``TFD225``); the model
    predicting its current input token (``TFD226``) more often than ``copy_threshold``, than the data repeats a token
    (by 0.25) and than at init (by :data:`COPY_RISE`)."""
    out: list[Verdict] = []
    if math.isfinite(loss) and abs(loss - expected) <= stall_tolerance * expected:
        out.append(
            Verdict(
                "TFD225",
                f"After {step} steps the loss {loss:.3f} is still within {stall_tolerance:.0%} of ln(V) = "
                f"{expected:.3f}, the loss of a uniform guess: the model has not started to learn.",
                {"loss": loss, "expected_loss": expected, "step": step, "learning_rates": list(learning_rates)[:8]},
            )
        )
    init_rate = init_copy_rate if init_copy_rate is not None else 0.0
    if (
        copy_rate == copy_rate
        and copy_rate > copy_threshold
        and copy_rate >= repeat_rate + 0.25
        and copy_rate >= init_rate + COPY_RISE
    ):
        out.append(
            Verdict(
                "TFD226",
                f"After {step} steps the model's top prediction equals the *current* input token at {copy_rate:.0%} "
                f"of positions (the data repeats a token at only {repeat_rate:.0%}; at init the model did so at "
                f"{init_rate:.0%}): it learned to copy its input.",
                {
                    "copy_rate": copy_rate,
                    "repeat_rate": repeat_rate,
                    "init_copy_rate": init_rate,
                    "step": step,
                    "shift_labels": shift_labels,
                },
            )
        )
    return out
