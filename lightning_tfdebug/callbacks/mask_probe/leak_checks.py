"""MaskProbe's rules on what leaks: a forward that is not repeatable (``TFD213``), future tokens reaching past
outputs (``TFD201``, ``TFD214``) and samples reaching each other (``TFD217``), each rule beside its decider.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key

if TYPE_CHECKING:
    pass
from lightning_tfdebug.callbacks.mask_probe.readings import CAUSAL, CROSS_SAMPLE, REPEAT, Number, Reading, _beyond
from lightning_tfdebug.functional.evidence_chart import EvidenceChart

# ------------------------------------------------------------------------------------------- repeat, causal, leaks
TFD213 = Rule(
    "TFD213",
    "error",
    "MaskProbe",
    title="the same inputs twice in eval mode gave different outputs (randomness ignores `.eval()`)",
    headline="eval mode is not deterministic: the same inputs moved the outputs by {max_change:.3g}",
    chart=EvidenceChart(
        "How far do the outputs move between two eval passes?",
        "output change",
        bars=("max_change", "tolerance"),
    ),
    trigger="two eval-mode forwards of the same inputs differ beyond the tolerance (the other checks are skipped)",
    details=(
        "On a probing step (the first training batch of each fit, and every `every_n_steps` when set), in eval mode "
        "under `no_grad` on the first `probe_rows` (default 2) rows cut to `probe_length` (default 64) tokens: two "
        "forwards of the same tokens differ by more than the tolerance, the relative tolerance of the compute dtype "
        "(1e-4 fp32, 5e-3 fp16, 2e-2 bf16 and other dtypes, 1e-7 fp64) times the largest |logit| of the reference "
        "pass; a NaN difference counts. The other probes of that step are skipped."
    ),
    hint=(
        "Something random runs regardless of `.eval()`: usually `F.dropout(x, p)` (its `training` argument "
        "defaults to True; pass `training=self.training` or use `nn.Dropout`), `dropout_p` given to "
        "`scaled_dot_product_attention` without checking `self.training`, or noise / sampling in `forward`. "
        "Validation and generation are then noisy as well."
    ),
    reason=(
        "Measured: the model is random in eval mode, so evaluation and inference of the trained model give "
        "different answers each call"
    ),
    message=(
        "The model is not a function of its input in eval mode: the same inputs twice gave outputs that differ by "
        "{max_change:.3g} at position {position} (row {row}; tolerance {tolerance:.2g}). The other MaskProbe checks "
        "are skipped: they would measure this noise."
    ),
)


@dataclass(frozen=True)
class RepeatReading(Reading):
    """Two eval-mode forwards of the same tokens: the largest logit difference, where, and the tolerance."""

    max_change: Number
    row: Number
    position: Number
    tolerance: Number
    LOGGED: ClassVar[Mapping[str, Key]] = {"max_change": REPEAT}


def _moved(rule: Rule, r: RepeatReading | CrossSampleReading) -> Verdict | None:
    """``rule``'s verdict when the largest change of ``r`` is beyond its tolerance."""
    if not _beyond(r.max_change, r.tolerance):
        return None
    evidence = {"max_change": r.max_change, "position": int(r.position), "row": int(r.row), "tolerance": r.tolerance}
    return rule.verdict(evidence)


def decide_repeat(r: RepeatReading) -> Verdict | None:
    """``TFD213`` when two eval-mode forwards of the same tokens differ beyond the tolerance."""
    return _moved(TFD213, r)


TFD201 = Rule(
    "TFD201",
    "error",
    "MaskProbe",
    title="future tokens change past logits; names the largest change, its row and position",
    headline="future tokens change past logits (max change {max_change:.3g} > tolerance {tolerance:.2g})",
    chart=EvidenceChart(
        "How far do the past logits move when a later token changes?",
        "logit change",
        bars=("max_change", "tolerance"),
    ),
    trigger=(
        "replacing the tokens after position t changed the logits at a position <= t beyond the dtype-aware tolerance"
    ),
    details=(
        'On a probing step (see `TFD213`), for a decoder (`causal=True`, `model_kind="decoder"`, or read from the '
        "labels and the model's kind): the tokens after the middle position of the probe rows are replaced with "
        "ordinary ids from the batch (never a known special id or the batch's padding value), and a logit at or "
        "before that position moves by more than the dtype-aware tolerance (see `TFD213`). Also raised by the leak "
        "probe when the token ids themselves carry the labels (label offset plus the model's shift at least 1) and an"
        " output up to the middle moves when they are replaced from the first position it must not see."
    ),
    hint=(
        "The decoder's attention does not apply a causal mask (or applies it wrongly): check the mask "
        "construction, `is_causal`, and any custom attention kernel. For an encoder, set `causal=False`."
    ),
    reason=(
        "A causal model that sees the future learns to copy it; it cannot generate, so the run cannot succeed as "
        "configured"
    ),
    message=(
        "Future tokens change past logits: replacing {replaced} changed {what} at position {position} (row {row}) by "
        "{max_change:.3g} (tolerance {tolerance:.2g}){outputs}."
    ),
)


@dataclass(frozen=True)
class CausalReading(Reading):
    """The tokens after ``cut`` of a ``length``-token sequence replaced: the largest logit change at or before it."""

    max_change: Number
    row: Number
    position: Number
    cut: int
    length: int
    tolerance: Number
    LOGGED: ClassVar[Mapping[str, Key]] = {"max_change": CAUSAL}


def decide_causal(r: CausalReading) -> Verdict | None:
    """``TFD201`` when replacing the tokens after ``cut`` moved a logit at or before it beyond the tolerance."""
    if not _beyond(r.max_change, r.tolerance):
        return None
    evidence = {"max_change": r.max_change, "position": int(r.position), "cut": r.cut, "tolerance": r.tolerance}
    replaced = f"the tokens after position {r.cut} of a {r.length}-token sequence"
    return TFD201.verdict(evidence, replaced=replaced, what="the logits", row=int(r.row), outputs="")


TFD214 = Rule(
    "TFD214",
    "error",
    "MaskProbe",
    title="the model reads the labels it is trained to predict through one of its inputs (a target leak)",
    headline="the model reads its labels through `{argument}` (max change {max_change:.3g} > {tolerance:.2g})",
    chart=EvidenceChart(
        "How far do the logits move when only the labels change?",
        "logit change",
        bars=("max_change", "tolerance"),
    ),
    trigger=(
        "in the call `training_step` makes, replacing the tokens of an argument that carries the labels (a "
        "decoder input, a second sequence) from the position of an output's own label on changed that output"
    ),
    details=(
        "On a probing step (see `TFD213`), for every argument of the recorded model call that carries the labels "
        "(equal to them at one offset at 95% or more of the supervised positions: a decoder input, a second sequence,"
        " the labels inside the call): its tokens are replaced with ordinary ids from the first position an output "
        "must not see (output `p` is trained on label `p`, or `p + 1` when the model shifts), and an output up to the"
        " middle position moves by more than the dtype-aware tolerance. When the argument is the token ids of a "
        "decoder-only call the finding is `TFD201` instead. The encoder input of an encoder-decoder is never "
        "perturbed."
    ),
    hint=(
        "The loss falls fast and the model learns to copy. A decoder input must be the labels shifted right "
        "(start token first: `decoder_input_ids[t] = labels[t-1]`), under a causal mask; an encoder must not see "
        "the text the decoder predicts (in a language model both sides read the same text, so the encoder needs "
        "a causal mask too, or use a decoder-only model)."
    ),
    reason=(
        "Measured: the model reads the labels it must predict; it learns to copy them and cannot do the task "
        "without them"
    ),
    message=(
        "Target leak: the model reads `{argument}`, which carries {carries} (label offset {label_offset}); replacing "
        "its tokens from position {replaced_from} on changed the output at position {position} (row {row}) by "
        "{max_change:.3g} (tolerance {tolerance:.2g}), so the model can copy the answer instead of predicting it."
    ),
)


@dataclass(frozen=True)
class LeakReading(Reading):
    """An argument carrying the labels (position t carries label t - ``label_offset``; ``primary``: the token ids),
    its tokens replaced from ``replaced_from`` on: the largest change of an output at or before ``cut``."""

    max_change: Number
    row: Number
    position: Number
    cut: int
    replaced_from: int
    argument: str
    label_offset: int | None
    primary: bool
    shift: int
    tolerance: Number


def decide_leak(r: LeakReading) -> Verdict | None:
    """``TFD201`` when the token ids leak (future tokens reach past outputs), ``TFD214`` when another argument that
    carries the labels does (a decoder input not shifted right)."""
    if not _beyond(r.max_change, r.tolerance):
        return None
    evidence = {
        "max_change": r.max_change,
        "position": int(r.position),
        "row": int(r.row),
        "cut": r.cut,
        "replaced_from": r.replaced_from,
        "argument": r.argument,
        "label_offset": r.label_offset,
        "tolerance": r.tolerance,
    }
    if r.primary and r.label_offset is not None and r.label_offset + r.shift >= 1:
        return TFD201.verdict(
            evidence,
            replaced=f"the tokens of `{r.argument}` from position {r.replaced_from} on",
            what="the output",
            outputs=f"; outputs up to {r.cut} must not see them",
        )
    own = r.label_offset == 0 and r.shift == 0
    return TFD214.verdict(
        evidence, carries="the label of its own position" if own else "labels the outputs are trained on"
    )


@dataclass(frozen=True)
class LeakSummary(Reading):
    """The leak probe's largest change, and how far the outputs moved when another argument than the ids changed."""

    largest: Number | None
    other_dependence: Number | None
    tolerance: Number
    LOGGED: ClassVar[Mapping[str, Key]] = {"largest": CAUSAL}

    @property
    def follows_other(self) -> bool:
        """The outputs follow another sequence of the call than the ids (an encoder-decoder's decoder)."""
        return self.other_dependence is not None and self.other_dependence > self.tolerance


# ------------------------------------------------------------------------------------------------------ cross-sample
CROSS_SAMPLE_ASIDE = (
    "cross-sample probe (TFD217)",
    "the probe rows hold one sample, so no other sample's outputs can be watched.",
    "batches of 2 samples or more, and `probe_rows` >= 2",
)
NO_SPECIAL_IDS = (
    "special ids",
    "no tokenizer or config names a special id: probe replacement ids are drawn from the ids the batch's real "
    "tokens use (never its padding value), which may include BOS, EOS or mask ids.",
    "a `tokenizer` attribute (DataModule, collator or LightningModule) or a Hugging Face config",
)
"""``(check, reason, setting)`` for ``check_aside``."""
TFD217 = Rule(
    "TFD217",
    "error",
    "MaskProbe",
    title="one sample's tokens change another sample's outputs: samples mix across the batch",
    headline="samples mix across the batch (max change {max_change:.3g} > {tolerance:.2g})",
    chart=EvidenceChart(
        "How far does one sample move when another changes?",
        "logit change",
        bars=("max_change", "tolerance"),
    ),
    trigger="in eval mode, replacing the tokens of one probe row moved another row's logits beyond the tolerance",
    details=(
        "Once per fit, at the first probe, with at least 2 probe rows (`probe_rows`, default 2; else stands aside, "
        "recorded): the tokens of the first probe row are replaced with ordinary ids, and another row's logits move "
        "by more than the dtype-aware tolerance (see `TFD213`), in eval mode (a BatchNorm with running statistics is "
        "not seen)."
    ),
    hint=(
        "A layer computes across the batch: a normalisation over it (BatchNorm over the tokens), a view or permute "
        "mixing the batch and sequence dimensions (`x.view(t, b, d)` of a `(b, t, d)` tensor), or attention over the "
        "wrong axis (`nn.MultiheadAttention` without `batch_first=True` fed batch-first tensors)."
    ),
    reason="Measured: a sample's outputs depend on the other samples of its batch, which are not its input",
    message=(
        "Samples mix across the batch: replacing the tokens of row 0 moved the logits of row {row} at position "
        "{position} by {max_change:.3g} (tolerance {tolerance:.2g})."
    ),
)


@dataclass(frozen=True)
class CrossSampleReading(Reading):
    """The tokens of the first probe row replaced: the largest logit change of the other rows, and where."""

    max_change: Number
    row: Number
    position: Number
    tolerance: Number
    LOGGED: ClassVar[Mapping[str, Key]] = {"max_change": CROSS_SAMPLE}


def decide_cross_sample(r: CrossSampleReading) -> Verdict | None:
    """``TFD217`` when another row's logits moved beyond the tolerance."""
    return _moved(TFD217, r)


BLOCK = ("TFD201", "TFD219")
"""The codes reserved for MaskProbe's rules."""

RULES: tuple[Rule, ...] = (
    TFD201,
    TFD213,
    TFD214,
    TFD217,
)
"""The rules decided in this module, in code order."""
