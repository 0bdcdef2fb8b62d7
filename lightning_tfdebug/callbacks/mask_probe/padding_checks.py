"""MaskProbe's rules on padding: real tokens' outputs that change with the ids under the mask (``TFD202``) or
with padding added on the pad side (``TFD203``), and a batch with padding but no mask (``TFD204``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key

if TYPE_CHECKING:
    pass
from lightning_tfdebug.callbacks.mask_probe.readings import PAD_SIDE, PADDING, Number, Reading, _beyond
from lightning_tfdebug.functional.evidence_chart import EvidenceChart

# ---------------------------------------------------------------------------------------------------------- padding
TFD202 = Rule(
    "TFD202",
    "error",
    "MaskProbe",
    title="tokens under the attention mask change the logits of real tokens",
    headline="masked tokens change real tokens' logits (max change {max_change:.3g} > {tolerance:.2g})",
    chart=EvidenceChart(
        "How far do real logits move when masked tokens change?",
        "logit change",
        bars=("max_change", "tolerance"),
    ),
    trigger=("changing the token ids at positions whose attention mask is 0 changed the logits of unmasked positions"),
    details=(
        "On a probing step with `check_padding` (default true) and a binary attention mask in the recorded call: a "
        "block of positions after the first is marked as padding and two different sets of ordinary ids are written "
        "under it; the logits of unmasked positions (every position when the outputs follow another sequence of the "
        "call) move by more than the dtype-aware tolerance (see `TFD213`). Info when the run's batches do not pad, or"
        " pad on the right of a model whose causality probe held: no real token reads the padding."
    ),
    hint=(
        "The attention mask does not reach the attention (or is inverted): check that the mask is passed through "
        "every layer and combined with the causal mask."
    ),
    reason=(
        "Measured: tokens the mask hides change real tokens' logits, so every padded batch trains on noise and "
        "inference depends on padding; info where the run's batches put no padding where real tokens read it"
    ),
    message=(
        "Tokens under the attention mask change real tokens' logits: changing the ids at the {masked} masked positions "
        "moved the logits at position {position} by {max_change:.3g} (tolerance {tolerance:.2g}).{harmless}"
    ),
)


def harmless(layout: str, causal: bool) -> str:
    """The sentence saying an ignored mask does no harm on batches that pad on ``layout`` (none, or right of a
    ``causal`` model); ``""`` when real tokens read padding."""
    if layout == "none":
        why = "they are not padded"
    elif layout == "right" and causal:
        why = "they pad on the right and attention is causal"
    else:
        return ""
    return (
        f" Harmless for this run's batches ({why}): no real token reads the padding. Wrong with left padding, "
        "bidirectional attention or batched generation."
    )


@dataclass(frozen=True)
class PaddingReading(Reading):
    """``masked`` positions marked as padding, their ids changed: the largest logit change at the real positions and
    at every position; ``layout``: the side the batch pads on."""

    max_change: Number
    position: Number
    every_change: Number
    every_position: Number
    masked: int
    tolerance: Number
    layout: str = "left"
    LOGGED: ClassVar[Mapping[str, Key]] = {"max_change": PADDING}


def decide_padding(r: PaddingReading, follows_other: bool = False, causal: bool = False) -> Verdict | None:
    """``TFD202`` when changing the ids under the mask moved a real token's logits (every output's when they
    ``follows_other`` sequence); info where that is :func:`harmless` (``causal``: the causality probe held)."""
    change, position = (r.every_change, r.every_position) if follows_other else (r.max_change, r.position)
    if not _beyond(change, r.tolerance):
        return None
    evidence = {"max_change": change, "position": int(position), "tolerance": r.tolerance, "layout": r.layout}
    note = harmless(r.layout, causal)
    return TFD202.verdict(evidence, severity="info" if note else None, masked=r.masked, harmless=note)


TFD203 = Rule(
    "TFD203",
    "error",
    "MaskProbe",
    title="the logits of real tokens depend on the amount of padding",
    headline="real tokens' logits depend on the padding (max change {max_change:.3g} > {tolerance:.2g})",
    chart=EvidenceChart(
        "How far do real logits move with more padding?",
        "logit change",
        bars=("max_change", "tolerance"),
    ),
    trigger="adding padding on the batch's padding side changed the logits of real tokens",
    details=(
        "On a probing step with `check_padding` (default true), when the outputs follow the ids' positions and no "
        "other sequence of that length is in the call: `t/4` padding tokens (the batch's own padding value, ordinary "
        "ids when it does not pad) are added on the side the batch pads (`padding_side`, default read from the mask, "
        "right when there is none), and a real token's logits move by more than the dtype-aware tolerance (see "
        "`TFD213`)."
    ),
    hint=(
        "Mask padding in attention; with left padding, derive position ids from the attention mask; avoid "
        "normalisations or poolings that run over padded positions."
    ),
    reason=(
        "Measured: real tokens' logits depend on how much padding the batch has, so the trained model computes a "
        "different function per batch"
    ),
    message=(
        "Logits of real tokens depend on the amount of padding: adding {extra} padding tokens on the {side} moved the "
        "logits at real position {position} by {max_change:.3g} (tolerance {tolerance:.2g})."
    ),
)


@dataclass(frozen=True)
class PadSideReading(Reading):
    """``extra`` padding positions added on ``side``: the largest change of a real token's logits."""

    max_change: Number
    position: Number
    side: str
    extra: int
    tolerance: Number
    LOGGED: ClassVar[Mapping[str, Key]] = {"max_change": PAD_SIDE}


def decide_pad_side(r: PadSideReading, follows_other: bool = False) -> Verdict | None:
    """``TFD203`` when adding padding on the batch's side moved a real token's logits (not checked when the outputs
    follow another sequence)."""
    if follows_other or not _beyond(r.max_change, r.tolerance):
        return None
    evidence = {"max_change": r.max_change, "side": r.side, "extra": r.extra, "tolerance": r.tolerance}
    return TFD203.verdict(evidence, position=int(r.position))


TFD204 = Rule(
    "TFD204",
    "error",
    "MaskProbe",
    title="the batch is padded but the model is called without a mask",
    headline="the batch is padded but the model is called without a mask",
    trigger=(
        "the batch pads (mask has zeros) but the model is called without an attention mask; info where the batches "
        "pad on the right of a causal model"
    ),
    details=(
        "On a probing step: the batch's attention mask has zeros but the recorded model call carries no mask. Info "
        "when the batch pads on the right of a decoder (by `causal`, `model_kind`, the model's kind or its labels): "
        "no real token reads the padding."
    ),
    hint="Pass the attention mask to the model's forward (or give MaskProbe a `forward_fn` that does).",
    reason=(
        "The recorded call shows real tokens read the padding the batch marks, as if it were text; info where no "
        "real token reads it (right padding, causal attention)"
    ),
    message=(
        "The batch is padded (its attention mask has zeros) but the model is called without a mask, so attention "
        "cannot ignore the padding.{harmless}"
    ),
)


def unpadded_mask(mask_key: str | None, layout: str = "left", causal: bool = False) -> Verdict:
    """``TFD204``: the batch pads on ``layout`` but the model is called without a mask; info where :func:`harmless`."""
    note = harmless(layout, causal)
    return TFD204.verdict({"mask_key": mask_key, "layout": layout}, severity="info" if note else None, harmless=note)


BLOCK = ("TFD201", "TFD219")
"""The codes reserved for MaskProbe's rules."""

RULES: tuple[Rule, ...] = (
    TFD202,
    TFD203,
    TFD204,
)
"""The rules decided in this module, in code order."""
