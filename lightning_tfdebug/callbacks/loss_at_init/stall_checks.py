"""LossAtInit's decisions at the check, without a Trainer: a loss stalled at ln(V) (``TFD225``), a model copying its
input (``TFD226``), outputs bounded above the data's floor (``TFD230``), and a loss at the labels' unigram entropy
with labels from other samples (``TFD231``) or a model ignoring its context (``TFD232``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict


def flat_window(window: Sequence[tuple[int, float]], loss: float, expected: float, tolerance: float) -> bool:
    """Whether the loss fell by less than ``tolerance`` of ln(V) from the highest finite point of ``window`` (True
    when there is none)."""
    earlier = [value for _, value in window if math.isfinite(value)]
    return not earlier or max(earlier) - loss <= tolerance * expected


TFD225 = Rule(
    "TFD225",
    "warning",
    "LossAtInit",
    title='at the check the loss is still at ln(V), flat over a window ("stalled at the uniform loss")',
    headline="loss stalled at ln V: {loss:.3f} at step {step} (ln V = {expected_loss:.3f})",
    chart=EvidenceChart(
        "Is the loss stuck at the uniform loss ln V?",
        "nats",
        logged=("loss_at_init/loss",),
        lines=("expected_loss",),
    ),
    trigger=(
        "at `check_step` (5x for masked-LM labels) the training loss is within `stall_tolerance` of ln(V) and fell"
        " by less than `stall_tolerance` of ln(V) since half-way to the check; the message compares it with the "
        "labels' unigram entropy"
    ),
    details=(
        "At `check_step` (default 100; `None` turns the check off; 5x `check_step` for masked-LM labels: at most half"
        " of the positions supervised and half of the supervised inputs one mask token): the training loss (undivided"
        " by accumulation, mean over ranks) is within `stall_tolerance` (default 0.05) of ln(V), and fell by at most "
        "`stall_tolerance` ln(V) from the highest finite loss measured since half-way to the check (measuring steps "
        "every `every_n_steps`, default the Trainer's `log_every_n_steps`). The message says whether the loss is "
        "above the labels' unigram entropy H (H below `(1 - stall_tolerance) ln(V)`) or H itself is near ln(V)."
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


COPY_RISE = 0.1
"""TFD226 needs the copy rate to have risen by this much since init (tied embeddings copy from the start)."""


TFD226 = Rule(
    "TFD226",
    "warning",
    "LossAtInit",
    title="at `check_step` the model predicts its current input token: labels not shifted",
    headline="labels not shifted: at step {step} the model copies its input ({copy_rate:.0%} of tokens)",
    chart=EvidenceChart(
        "How often does the model predict its current input token?",
        "fraction of tokens",
        bars=("copy_rate", "repeat_rate", "init_copy_rate"),
    ),
    trigger=(
        "at `check_step` the argmax equals the current input token at more than `copy_threshold` of positions, "
        "0.25 above the data's own repeat rate, and 0.1 above the rate at step 0 (tied embeddings copy from init)"
    ),
    details=(
        "At `check_step` (default 100), on at most `max_rows` sampled positions: the copy rate (share of positions "
        "whose argmax is the current input token, inputs from `input_key` or found, the decoder's input for an "
        "encoder-decoder) is above `copy_threshold` (default 0.5), at least 0.25 above the data's repeat rate "
        "(`inputs[t] == inputs[t+1]`) and at least 0.1 above the copy rate measured at step 0 (models with tied "
        "embeddings copy from init: 59-72% for the tests' tiny GPT-2)."
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


FLOOR_PINNED = 0.3
"""TFD230: the loss is above the floor by at most this fraction of the way up to ln(V) (healthy runs: 0.4 and more)."""


FLOOR_ABOVE_DATA = 0.05
"""... and the floor is above the labels' unigram entropy by at least this fraction of ln(V) ..."""


RANGE_SPREAD = 0.05
"""... and the rows' ranges spread by at most this fraction of their mean (a saturated tanh: 0.009; healthy: 0.12)."""


TFD230 = Rule(
    "TFD230",
    "warning",
    "LossAtInit",
    title="the loss is pinned at the floor of outputs squashed into a bounded range (sigmoid, tanh, clamp)",
    headline="the loss is pinned at the floor of squashed outputs (loss {loss:.3f}, floor {floor:.3f} nats)",
    chart=EvidenceChart(
        "Is the loss pinned at the floor of bounded outputs?",
        "nats",
        logged=("loss_at_init/loss",),
        lines=("floor", "unigram_entropy", "expected_loss"),
    ),
    trigger=(
        "at the check the logits' cross-entropy has left ln(V) and lies within 30% of the way from the floor "
        "`ln(1 + (V-1) e^-w)` of the rows' logit ranges `w` up to ln(V), the floor is 5% of ln(V) above the labels' "
        "unigram entropy, and the rows' ranges are alike (spread at most 5% of their mean)"
    ),
    details=(
        "At the check, from the captured logits' own cross-entropy `C` and the floor `F`, the mean over sampled rows "
        "of `ln(1 + (V-1) e^-w)` with `w` a row's logit range (max minus min): `C` is at least `stall_tolerance` "
        "(default 0.05) below ln(V), `C - F` is at most 30% of `ln(V) - F`, `F` is above the labels' unigram entropy "
        "by at least 5% of ln(V), and the rows' ranges spread by at most 5% of their mean (a saturated tanh: 0.9%; "
        "healthy rows: 12%). Healthy runs in the tests stay 40% of the way and more above their floor."
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


_CONTEXT_HEAD = (
    "At step {step} the loss {loss:.3f} sits at the labels' unigram entropy ({unigram_entropy:.3f}: token frequencies "
    "only), and the model predicts its own sample's labels no better than its neighbour's ({rolled_loss:.3f} with the "
    "labels rolled by one sample)"
)
"""The first sentence of ``TFD231`` and ``TFD232``."""


CONTEXT_GAP = 0.01
"""TFD231/TFD232: the own labels' loss beats the neighbour's by less than this fraction."""


UNIGRAM_BAND = (0.85, 1.1)
"""The loss counts as "at the unigram entropy" between these multiples of it."""


STALL_STEPS = 20
"""TFD232 claims a stall at the unigram entropy only over a window of at least this many steps."""


RELATION_MARGIN = 0.2
"""Labels belong to inputs (own or the neighbour's) that they repeat at half the positions and this much more often."""


TFD231 = Rule(
    "TFD231",
    "warning",
    "LossAtInit",
    title="labels from other samples: the loss sits at the unigram entropy and ignores which sample it is",
    headline="labels from other samples: loss {loss:.3f} at the unigram entropy {unigram_entropy:.3f} nats",
    chart=EvidenceChart(
        "Does the loss sit at the unigram entropy?",
        "nats",
        logged=("loss_at_init/loss",),
        lines=("unigram_entropy", "rolled_loss"),
    ),
    trigger=(
        "at the check the loss is at the labels' unigram entropy (0.85x to 1.1x), the loss against labels rolled "
        "by one sample along the batch is within 1% of it, and the labels do not repeat their own inputs more "
        "than a neighbour's (masked-LM labels: do not sit on their own inputs' mask tokens more than on a "
        "neighbour's); an error when they repeat the neighbour's, or when there is one label per sequence and the "
        "loss stayed flat at chance; info when the labels' relation to the inputs cannot be measured per position "
        "(an encoder-decoder)"
    ),
    details=(
        "At the check: the loss is 0.85x to 1.1x the labels' unigram entropy H (Miller-Madow corrected, counted over "
        "the first 8 measuring steps on all ranks), and the cross-entropy against the labels rolled by one sample "
        "along the batch is less than 1% above it. Then, from the share of positions where the labels repeat their "
        "own inputs (own) and the neighbouring sample's (rolled): an error when rolled >= 0.5 and >= own + 0.2 "
        "(joined off by one row), a warning when neither side wins (labels from other samples, or a task whose labels"
        " never repeat the inputs with a model that ignores them). With one label per sequence (`(B,)` labels beside "
        "`(B, C)` logits: a classifier) the relation is not measured: an error once the loss has also been flat over "
        "a window of at least 20 steps (the run learns nothing from its inputs: labels joined to the wrong rows, or "
        "the model cannot see what decides them). Info when the relation cannot be measured per position (no token "
        "inputs shaped like the labels, e.g. an encoder-decoder on its plateau). Masked-LM labels are compared by "
        "whose mask tokens they sit on. Dropped when `TFD233` is raised."
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
    per_sequence: bool = False,
) -> Verdict | None:
    """``TFD231`` / ``TFD232``: the loss sits at the labels' unigram entropy and the model predicts its own sample's
    labels no better than its neighbour's (``rolled_loss``). What the labels repeat (``own_match`` /
    ``rolled_match``, masked LM: whose masks they sit on) tells which side is at fault: the neighbour's inputs, or
    neither, ``TFD231`` (labels from other samples); their own, ``TFD232`` (the model ignores its context), once the
    loss is ``flat`` over :data:`STALL_STEPS` steps (``window_steps``). Harm sets the severity of ``TFD231``: an error
    where the labels are the neighbours' (measured) or are one per sequence (``per_sequence``, a classifier) with the
    loss flat at chance over the window; info where nothing tells the two sides apart per position (an
    encoder-decoder on its plateau).
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
    rolled_is_own = measured and rolled_match >= 0.5 and rolled_match >= own_match + RELATION_MARGIN
    if rolled_is_own:
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
    elif per_sequence and flat and window_steps >= STALL_STEPS:
        # one label per sequence, the loss flat at the labels' entropy over the window and no better on the own rows'
        # labels than on the neighbours': whatever the model reads of its inputs says nothing of its labels
        why = (
            f"the loss stayed flat at chance for {window_steps} steps: the labels (one per sequence) do not depend on "
            "what the model sees of its inputs. Either they are joined to the wrong rows, or the model cannot see what "
            "decides them (the input that carries the class never reaches it, or it cannot see token order)"
        )
        return TFD231.verdict(evidence, severity="error", step=step, why=why)
    else:
        # unmeasured per position (an encoder-decoder's labels enter only its decoder): a model still on the unigram
        # plateau, as a healthy encoder-decoder is while its cross-attention forms, reads the same: no warning earned
        why = (
            "the labels do not depend on the inputs (they belong to other samples), or the model ignores its inputs; "
            "with no token inputs shaped like the labels this cannot be told apart here"
        )
        return TFD231.verdict(evidence, severity="info", step=step, why=why)
    if rolled_is_own:
        return TFD231.verdict(evidence, severity="error", step=step, why=why)
    return TFD231.verdict(evidence, step=step, why=why)


TFD232 = Rule(
    "TFD232",
    "warning",
    "LossAtInit",
    title="the model ignores its context: the loss stalls at the labels' unigram entropy (token frequencies only)",
    headline="the model ignores its context: loss {loss:.3f} at the unigram entropy {unigram_entropy:.3f} nats",
    chart=EvidenceChart(
        "Does the loss sit at the unigram entropy?",
        "nats",
        logged=("loss_at_init/loss",),
        lines=("unigram_entropy",),
    ),
    trigger=(
        "at the check the loss is flat at the labels' unigram entropy (0.85x to 1.1x), the loss against labels "
        "rolled by one sample is within 1% of it, and the labels repeat their own inputs (so they are right); "
        "info for masked-LM labels that sit on their own inputs' mask tokens (the masked-LM plateau, longer at a "
        "lower learning rate)"
    ),
    details=(
        "As `TFD231` (loss 0.85x to 1.1x the unigram entropy, rolled-label loss less than 1% above it), but the "
        "labels repeat their own inputs at 50% of positions or more and 0.2 more often than the neighbour's, and the "
        "loss is flat over a window of at least 20 steps (fell by at most `stall_tolerance` ln(V) since half-way to "
        "the check). Info for masked-LM labels that sit on their own inputs' mask tokens (the masked-LM plateau). "
        "Dropped when `TFD233` is raised."
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


RULES: tuple[Rule, ...] = (TFD225, TFD226, TFD230, TFD231, TFD232)
"""The rules decided in this module, in code order."""

BLOCK = ("TFD220", "TFD239")
"""The codes reserved for LossAtInit's rules (every one of its rule modules declares the same)."""
