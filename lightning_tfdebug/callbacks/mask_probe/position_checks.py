"""MaskProbe's rules on positions: the context limit (``TFD207``-``TFD209``), a KV cache that disagrees with the
full forward (``TFD215``), a model blind to token order (``TFD216``), and position tables that cannot be read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from lightning_tfdebug.functional.evidence_chart import EvidenceChart
from lightning_tfdebug.functional.verdicts import Rule, Verdict
from lightning_tfdebug.primitives.keys import Key

if TYPE_CHECKING:
    pass
from lightning_tfdebug.callbacks.mask_probe.readings import (
    CONTENT,
    KV_CACHE,
    ORDER,
    ORDER_STEPS,
    Number,
    Reading,
    _beyond,
)

# -------------------------------------------------------------------------------------------------------- positions
TFD207 = Rule(
    "TFD207",
    "error",
    "MaskProbe",
    title="the model fails on a sequence exactly at its context limit",
    headline="the model fails on a sequence at its context limit of {context_limit} tokens",
    trigger="a sequence exactly at the context limit fails",
    details=(
        "Once per fit, with `check_positions` (default true): a probe row of exactly the context limit "
        "(`context_limit`, else `context_length` / `max_position_embeddings` / `n_positions` / `block_size` from "
        "`hparams` or a Hugging Face config, else a position embedding's size) raises in the forward. Nothing longer "
        "is sent (past-the-limit sequences only on CPU)."
    ),
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
    details=(
        "Info, once per fit with `check_positions` (default true): a sequence exactly at the context limit ran; "
        "states the limit and where it was read (see `TFD207`)."
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
    headline=(
        "incremental decoding disagrees with the full forward from position {first_position} (change {max_change:.3g})"
    ),
    chart=EvidenceChart(
        "How far does incremental decoding move the logits?",
        "logit change",
        bars=("max_change", "tolerance"),
    ),
    trigger="logits from `kv_cache_fn` (incremental decoding) differ from the full forward's",
    details=(
        "Only with `kv_cache_fn`, on a probing step: the logits it decodes step by step differ from the full "
        "forward's at some position by more than the dtype-aware tolerance (see `TFD213`); names the first such "
        "position."
    ),
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
    headline="the model ignores token order (order change {order_change:.3g} <= {tolerance:.2g})",
    chart=EvidenceChart(
        "Do the logits change when the token order does?",
        "logit change",
        bars=("order_change", "content_change", "tolerance"),
    ),
    trigger=(
        "from step 100, reversing the tokens before a position leaves that position's output unchanged while "
        "replacing them moves it by over 100x the tolerance; on a model read without token ids (or with one output "
        "per sequence), permuting its input positions permutes its outputs alike, on an objective that needs order"
    ),
    details=(
        "At steps 100, 200 and 500 until decided: the tokens before a position are reversed, and separately replaced."
        " Fires when the reversal moves that position's output by at most the dtype-aware tolerance (see `TFD213`) "
        "while the replacement moves it by more than 100x the tolerance. Decided silent once the reversal moves it by"
        " more than 10x the tolerance. A model read without token ids or returning one output per sequence (the "
        "any-inputs probes, `order_checks.py`): at the first "
        "probe, the recorded model call is replayed with the positions of its sequence tensors (every `(B, T)` "
        "integer and `(B, T, F)` float argument of one length `T`: ids, features, masks, per-position labels) "
        "reversed, all but the first, the last and the padded ones, and separately with their values taken from "
        "another row. Order-blind when the reversal moves the outputs (per position: against the original outputs "
        "reversed alike) by at most the tolerance while the replacement moves them by more than 10x; probed again at "
        "the decision step (step 100 after the first probe, or the fit's last step), and decided there: an error when"
        " a row holds the same inputs at two supervised positions with different labels and the mean returned loss "
        "of the 10 steps up to the decision step is not below 0.9 x that of the first 5 (from a decision step of 20 "
        "on), a warning when one of the two holds, else `TFD218` (info)."
    ),
    hint=(
        "Check that positions are added for every position: a sinusoidal table indexed as `pe[:, x.size(1)]` "
        "adds one row to all positions (use `pe[:, : x.size(1)]`); position ids that are all zero or never "
        "passed; a position embedding added to the wrong tensor; rotary embeddings applied with a constant "
        "offset."
    ),
    reason=(
        "Measured: no position information reaches attention, so the model cannot use token order: a language model"
        " cannot succeed. Without token ids, an error when both the labels and the loss show the objective needs "
        "order, a warning on one of them"
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
    headline="position table `{table}` gives the same row at every position",
    trigger=(
        "in one forward of the probe rows, a table of the token table's width with at least as many rows as the "
        "sequence (> 1) is looked up with indices constant along it, or is never read"
    ),
    details=(
        "Once per fit, at the first probe: one forward of the probe rows with every embedding weight and hand-held "
        "table parameter watched. A position table is a table of the token table's width (the one looked up with the "
        "call's ids) with at least as many rows as the sequence; fires, for a sequence of at least 2 tokens, when "
        "such a table is looked up (`F.embedding` or integer indexing) with indices constant along the sequence, or "
        "is read by no torch function at all."
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


BLOCK = ("TFD201", "TFD219")
"""The codes reserved for MaskProbe's rules."""

RULES: tuple[Rule, ...] = (
    TFD207,
    TFD208,
    TFD209,
    TFD215,
    TFD216,
)
"""The rules decided in this module, in code order."""
