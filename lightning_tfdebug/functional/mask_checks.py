"""The rules MaskProbe decides, each beside its reading. :func:`decide_probe` decides one probing step's readings.

Example:
    >>> decide_causal(CausalReading(max_change=0.5, row=0, position=3, cut=4, length=8, tolerance=1e-2)).code
    'TFD201'
    >>> decide_causal(CausalReading(max_change=1e-3, row=0, position=3, cut=4, length=8, tolerance=1e-2)) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_tfdebug.functional.probes import classify_alignment
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key

if TYPE_CHECKING:
    from lightning_tfdebug.primitives.calls import Objective

Number = Any
"""A number of a reading: a device scalar (0-d tensor) while probing, a host float after :func:`on_host`."""

ALIGNMENT_RETRY_STEPS = (1, 5, 20, 50, 100, 200, 500)
"""Steps at which a target-alignment check that could not decide yet (losses of the two alignments too close on a
freshly initialised model) is tried again. Fixed, so every rank tries at the same steps."""

ORDER_STEPS = (100, 200, 500)
"""Steps at which the token-order check runs until it decides. Not before step 100: attention of a freshly initialised
model is nearly uniform, so its outputs hardly depend on token order even when positions reach it."""


def _beyond(change: float, tolerance: float) -> bool:
    return not change <= tolerance  # also NaN: a NaN output is not a clean pass


# ------------------------------------------------------------------------------------------------------- logged keys
_KEYS: list[Key] = []


def _key(name: str, description: str, unit: str = "") -> Key:
    """A MaskProbe key, added to :data:`KEYS` in the order defined."""
    _KEYS.append(Key(f"mask_probe/{name}", description, unit, chart="mask probes"))
    return _KEYS[-1]


REPEAT = _key("repeat_max_change", "largest logit difference between two forwards of the same tokens")
CAUSAL = _key("causal_max_change", "largest logit change at positions before the edited tokens")
PADDING = _key("padding_max_change", "largest real-token logit change when the ids under the mask change")
PAD_SIDE = _key("pad_side_max_change", "largest real-token logit change when padding is added on the pad side")
KV_CACHE = _key("kv_cache_max_change", "largest difference between incremental and full-forward logits")
LOSS_RETURNED = _key("loss_returned", "the loss `training_step` returned on the batch (eval mode, `no_grad`)", "nats")
LOSS_SHIFTED = _key("loss_shifted", "cross-entropy of the same logits, position t against label t+1", "nats")
LOSS_SHIFTED2 = _key("loss_shifted2", "the same, position t against label t+2", "nats")
LOSS_UNSHIFTED = _key("loss_unshifted", "the same, position t against label t", "nats")
CONTEXT_LIMIT = _key("context_limit", "the context limit the position probes used", "tokens")
ORDER = _key("order_change", "largest change of a position's output when the tokens before it are reversed")
CONTENT = _key("content_change", "largest change of that output when the tokens before it are replaced")
SECONDS = _key("seconds", "wall time of the probe", "s")
CROSS_SAMPLE = _key("cross_sample_max_change", "largest logit change of other samples when one sample's tokens change")
KEYS: tuple[Key, ...] = tuple(_KEYS)
"""Every scalar MaskProbe logs (on probing steps only): ``MaskProbe.KEYS``."""


# ----------------------------------------------------------------------------------------------------------- readings
@dataclass(frozen=True)
class Reading:
    """What one probe measured. ``LOGGED`` maps a field to the key it is logged under."""

    LOGGED: ClassVar[Mapping[str, Key]] = {}

    def logged(self) -> dict[str, float]:
        """The logged scalars of this reading (host numbers: after the transfer)."""
        return {key.name: float(getattr(self, f)) for f, key in self.LOGGED.items() if getattr(self, f) is not None}


# ------------------------------------------------------------------------------------------- repeat, causal, leaks
TFD213 = Rule(
    "TFD213",
    "error",
    "MaskProbe",
    title="the same tokens twice in eval mode gave different logits (randomness ignores `.eval()`)",
    trigger="two eval-mode forwards of the same tokens differ beyond the tolerance (the other checks are skipped)",
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
        "The model is not a function of its input in eval mode: the same tokens twice gave logits that differ by "
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
    trigger=(
        "replacing the tokens after position t changed the logits at a position <= t beyond the dtype-aware tolerance"
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
    trigger=(
        "in the call `training_step` makes, replacing the tokens of an argument that carries the labels (a "
        "decoder input, a second sequence) from the position of an output's own label on changed that output"
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


# ---------------------------------------------------------------------------------------------------------- padding
TFD202 = Rule(
    "TFD202",
    "error",
    "MaskProbe",
    title="tokens under the attention mask change the logits of real tokens",
    trigger=("changing the token ids at positions whose attention mask is 0 changed the logits of unmasked positions"),
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
    trigger="adding padding on the batch's padding side changed the logits of real tokens",
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
    trigger=(
        "the batch pads (mask has zeros) but the model is called without an attention mask; info where the batches "
        "pad on the right of a causal model"
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


# -------------------------------------------------------------------------------------------------------- positions
TFD207 = Rule(
    "TFD207",
    "error",
    "MaskProbe",
    title="the model fails on a sequence exactly at its context limit",
    trigger="a sequence exactly at the context limit fails",
    hint=(
        "Check the position table / rotary cache size against the configured context length, or pass the real "
        "limit as `context_limit`."
    ),
    reason="A sequence of the length the model claims to accept fails: the run fails when the data reaches that length",
    message=("The model fails on a sequence of {context_limit} tokens, its context limit: {error}"),
)


def context_failure(limit: int, error: BaseException) -> Verdict:
    """``TFD207``: the model fails on a sequence of its own context limit."""
    return TFD207.verdict({"context_limit": limit}, error=f"{type(error).__name__}: {error}")


TFD208 = Rule(
    "TFD208",
    "info",
    "MaskProbe",
    title="the context limit, and where it was read",
    trigger=(
        "states the context limit and where it was read, once a sequence of that length ran (nothing longer is "
        "ever sent to the model)"
    ),
    hint=("Cut or chunk batches to the context limit before the forward (BatchGuard checks batches against it)."),
    reason="An observation: the context limit and where it was read, for the reader to confirm",
    message=(
        "Context limit: {context_limit} tokens{where}; a sequence of {context_limit} tokens runs. Longer batches "
        "must be cut or chunked before the forward."
    ),
)


def context_limit_runs(limit: int, source: str = "") -> Verdict:
    """``TFD208`` (info): the context limit, where it was read, and that a sequence of that length runs."""
    return TFD208.verdict({"context_limit": limit, "source": source}, where=f" (read from {source})" if source else "")


TFD209 = Rule(
    "TFD209",
    "error",
    "MaskProbe",
    title="incremental decoding (`kv_cache_fn`) disagrees with the full forward; names the first position",
    trigger="logits from `kv_cache_fn` (incremental decoding) differ from the full forward's",
    hint="Check the cache position / offset passed at each decoding step, rotary offsets, and the mask with a cache.",
    reason="Measured: incremental decoding computes other logits than training, so the trained model generates wrongly",
    message=(
        "Incremental decoding disagrees with the full forward: logits differ by up to {max_change:.3g}, first at "
        "position {first_position} (tolerance {tolerance:.2g})."
    ),
)


@dataclass(frozen=True)
class KvCacheReading(Reading):
    """Incremental decoding against the full forward: the largest difference, the first position beyond tolerance."""

    max_change: Number
    first_position: Number
    tolerance: Number
    LOGGED: ClassVar[Mapping[str, Key]] = {"max_change": KV_CACHE}


def decide_kv_cache(r: KvCacheReading) -> Verdict | None:
    """``TFD209`` when incremental decoding's logits differ from the full forward's beyond the tolerance."""
    if not _beyond(r.max_change, r.tolerance):
        return None
    return TFD209.verdict({"max_change": r.max_change, "first_position": int(r.first_position)}, tolerance=r.tolerance)


TFD215 = Rule(
    "TFD215",
    "error",
    "MaskProbe",
    title="the model ignores token order: no position information reaches the attention",
    trigger=(
        "from step 100, reversing the tokens before a position leaves that position's output unchanged while "
        "replacing them moves it by over 100x the tolerance"
    ),
    hint=(
        "Check that positions are added for every position: a sinusoidal table indexed as `pe[:, x.size(1)]` "
        "adds one row to all positions (use `pe[:, : x.size(1)]`); position ids that are all zero or never "
        "passed; a position embedding added to the wrong tensor; rotary embeddings applied with a constant "
        "offset."
    ),
    reason=(
        "Measured: no position information reaches attention, so the model cannot use token order: a language model"
        " cannot succeed"
    ),
    message=(
        "The model ignores token order: reversing the {position} tokens before position {position} left its output "
        "unchanged (largest change {order_change:.3g}, tolerance {tolerance:.2g}) while replacing them moved it by "
        "{content_change:.3g}. No position information reaches the attention."
    ),
)


@dataclass(frozen=True)
class OrderReading(Reading):
    """The tokens before ``position`` reversed (``order_change``) and replaced (``content_change``): the largest change
    of that position's output, at ``step``."""

    order_change: Number
    content_change: Number
    position: int
    tolerance: Number
    step: int
    last_try: bool
    LOGGED: ClassVar[Mapping[str, Key]] = {"order_change": ORDER, "content_change": CONTENT}


def decide_order(r: OrderReading) -> tuple[bool, Verdict | None]:
    """``(decided, verdict)`` of the token-order check (``TFD215``)."""
    if r.order_change > 10 * r.tolerance:
        return True, None
    if r.step < ORDER_STEPS[0] or not r.content_change > 100 * r.tolerance or r.order_change > r.tolerance:
        return r.last_try, None  # too early, the content hardly matters, or the order moved it somewhat
    evidence = {
        "order_change": r.order_change,
        "content_change": r.content_change,
        "position": r.position,
        "tolerance": r.tolerance,
        "step": r.step,
    }
    return True, TFD215.verdict(evidence)


TFD216 = Rule(
    "TFD216",
    "warning",
    "MaskProbe",
    title="a position table gets the same row at every position, or is never read",
    trigger=(
        "in one forward of the probe rows, a table of the token table's width with at least as many rows as the "
        "sequence (> 1) is looked up with indices constant along it, or is never read"
    ),
    hint=(
        "Pass position ids that count along the sequence (`torch.arange(t)`, or the mask's cumulative sum minus "
        "one with left padding), not zeros; add the position table to the token embeddings in the forward."
    ),
    reason=(
        "Breaks a rule that always holds for a model built with a position table: every position reads its own "
        "row. The harm is measured only indirectly (with causal layers the mask alone carries some order), so a "
        "warning, not an error"
    ),
    message=(
        "Every position gets the same row of the position table `{table}` ({rows} rows): the forward looks it up "
        "with indices that are constant along the sequence ({length} tokens), so no position information reaches the "
        "model beyond what a causal mask implies."
    ),
)

_UNREAD_TABLE = (
    "The model holds a position table `{table}` ({rows} rows, the width of the token table `{token_table}`) that the "
    "forward never reads: the token embedding is looked up, positions are never added."
)


@dataclass(frozen=True)
class PositionTable:
    """A candidate position table and what the forward did with it: ``read`` at all, ``looked_up`` along the sequence,
    and ``constant`` (every such lookup constant along it: a device bool while probing)."""

    name: str
    rows: int
    read: bool
    looked_up: bool
    constant: Number


@dataclass(frozen=True)
class PositionTablesReading(Reading):
    """The position tables one watched forward pass of ``length`` tokens used, beside the token table."""

    tables: tuple[PositionTable, ...]
    length: int
    token_table: str


def decide_position_tables(r: PositionTablesReading) -> Verdict | None:
    """``TFD216`` when a position table is looked up with indices constant along the sequence, or never read."""
    if r.length < 2:
        return None
    constant = [t for t in r.tables if t.looked_up and bool(t.constant)]
    unread = [t for t in r.tables if not t.read]
    if not constant and not unread:
        return None
    t = (constant or unread)[0]
    kind = "constant" if constant else "unread"
    evidence = {"table": t.name, "rows": t.rows, "length": r.length, "kind": kind, "token_table": r.token_table}
    if constant:
        hint = (
            f"Pass position ids that count along the sequence to the lookup of `{t.name}` (e.g. `torch.arange(t)`, "
            "or the mask's cumulative sum minus one with left padding), not zeros."
        )
        return TFD216.verdict(evidence, hint=hint)
    hint = f"Add `{t.name}` (its first {r.length} rows, or its lookup of the position ids) to the token embeddings."
    # a second sentence of this code that the template (the constant lookup's) cannot express
    return TFD216.verdict(evidence, hint=hint, message=_UNREAD_TABLE.format(**evidence))


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
    trigger="in eval mode, replacing the tokens of one probe row moved another row's logits beyond the tolerance",
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


# -------------------------------------------------------------------------------------------------- target alignment
TFD205 = Rule(
    "TFD205",
    "error",
    "MaskProbe",
    title="labels not shifted: position t is trained on token t (the model learns to copy its input)",
    trigger=(
        "the loss `training_step` returned equals the cross-entropy of position t against token t (labels equal "
        "to the inputs, no shift)"
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
    trigger=(
        "position t trained on token t+2: labels shifted in the data and again by the loss, or equal to the inputs "
        "and shifted twice by `training_step` (by hand, then inside a Hugging Face model)"
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
    title=("target alignment undetermined (loss matches neither alignment, or `training_step` could not be replayed)"),
    trigger=(
        "the returned loss matches neither alignment (label smoothing, auxiliary losses), or `training_step` "
        "could not be replayed"
    ),
    hint="nothing if expected; otherwise check `labels_key` / `ignore_index`",
    reason="An observation: the alignment could not be decided from the loss, so nothing was claimed about it",
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
    title="with `causal=None`, the labels are neither the inputs nor the next inputs: treated as an encoder",
    trigger=(
        "`causal=None` and the labels are neither the inputs nor the next inputs at most supervised positions "
        "(masked-LM / denoising): causality and target alignment are not checked"
    ),
    hint="If this model is a decoder, set `causal=True` to check its causal mask; `causal=False` silences this.",
    reason="An observation of the objective (a masked-LM or denoising task), which makes the causal probes not apply",
    message=(
        "Treated as an encoder: at the supervised positions the labels equal the inputs {same_frac:.0%} of the time "
        "and the next inputs {next_frac:.0%} (a next-token objective has one of them near 100%), so the objective is "
        "masked-LM or denoising. Causality and target alignment are not checked."
    ),
)


def decide_objective(objective: Objective) -> Verdict | None:
    """Decoder (None) or encoder (``TFD212``), from what the labels ask the model to predict."""
    if objective.next_token:
        return None
    supervised_next = max(objective.supervised_next, 1.0)
    evidence = {
        "same_frac": objective.same / objective.supervised,
        "next_frac": objective.following / supervised_next,
        "supervised_frac": objective.supervised / max(objective.label_positions, 1),
    }
    return TFD212.verdict(evidence)


# --------------------------------------------------------------------------------------------------- one probing step
def decide_probe(readings: Sequence[Reading]) -> tuple[list[Verdict | None], set[str]]:
    """The verdicts of one probing step's readings, and the pending checks it settled. A repeat beyond its tolerance
    (``TFD213``) is then the only verdict: every other comparison would measure its noise."""
    repeat = next((r for r in readings if isinstance(r, RepeatReading)), None)
    noisy = None if repeat is None else decide_repeat(repeat)
    if noisy is not None:
        return [noisy], {"alignment"}
    follows = any(r.follows_other for r in readings if isinstance(r, LeakSummary))
    causal = [r for r in readings if isinstance(r, CausalReading) or (isinstance(r, LeakReading) and r.primary)]
    held = bool(causal) and not any(_beyond(r.max_change, r.tolerance) for r in causal)
    verdicts: list[Verdict | None] = []
    settled: set[str] = set()
    for r in readings:
        if isinstance(r, (AlignmentReading, OrderReading)):
            decided, verdict = decide_alignment(r) if isinstance(r, AlignmentReading) else decide_order(r)
            if decided:
                settled.add("alignment" if isinstance(r, AlignmentReading) else "order")
            verdicts.append(verdict)
        elif isinstance(r, (PaddingReading, PadSideReading)):
            verdicts.append(
                decide_padding(r, follows, held) if isinstance(r, PaddingReading) else decide_pad_side(r, follows)
            )
        elif type(r) in _RULE_OF:
            verdicts.append(_RULE_OF[type(r)](r))
    return verdicts, settled


_RULE_OF: dict[type, Callable[[Any], Verdict | None]] = {
    CausalReading: decide_causal,
    LeakReading: decide_leak,
    KvCacheReading: decide_kv_cache,
    PositionTablesReading: decide_position_tables,
    CrossSampleReading: decide_cross_sample,
}

BLOCK = ("TFD201", "TFD219")
"""The codes reserved for MaskProbe's rules."""

RULES: tuple[Rule, ...] = (
    TFD201,
    TFD202,
    TFD203,
    TFD204,
    TFD205,
    TFD206,
    TFD207,
    TFD208,
    TFD209,
    TFD210,
    TFD211,
    TFD212,
    TFD213,
    TFD214,
    TFD215,
    TFD216,
    TFD217,
)
"""The rules decided in this module, in code order."""
