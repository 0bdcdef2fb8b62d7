"""``TFD124``: the end-of-sequence token occurs among the inputs and is never supervised. The special-token counts
of the first checked batches are summed by name (:meth:`SpecialTokenTally.update`) apart from the decision
(:func:`eos_never_supervised`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.callbacks.batch_guard.statistics import special_token_statistics
from lightning_tfdebug.functional.special_ids import SpecialIds
from lightning_tfdebug.functional.verdicts import Rule, Verdict

CAUSAL_MATCH = 0.8
"""Aligned labels are a causal LM's when this share of the supervised ones equal the id at the same position or the
next one; a masked LM's match mostly neither (about 10%: the tokens kept unmasked)."""


def label_layout(ids: Tensor, labels: Tensor | None, encoder_decoder: bool = False) -> tuple[bool, bool]:
    """How a batch's labels lie against its ids (shapes only): aligned position for position (never an
    encoder-decoder's), and token sequences (aligned, or one row of targets per row of ids)."""
    if labels is None:
        return False, False
    aligned = not encoder_decoder and labels.numel() == ids.numel()
    rows = ids.shape[0] if ids.ndim >= 2 else 1
    return aligned, aligned or (labels.ndim >= 2 and labels.shape[0] == rows)


EOS_CHECK = "EOS supervision (TFD124)"
"""The name under which ``TFD124``'s count stands aside alone while the rest of BatchGuard runs on."""


def eos_count_aside(
    ids: SpecialIds, *, has_labels: bool = True, sequences: bool = True, has_mask: bool = True
) -> tuple[str, str | None] | None:
    """Why ``TFD124``'s count cannot run, and the setting that would let it (None: it can)."""
    if not ids.eos:
        reason = "no end-of-sequence id is known (no `eos_id`, no tokenizer, no Hugging Face config naming one)."
        return reason, "`eos_id` or `tokenizer`"
    if not has_labels:
        return "the batches have no integer token labels to count EOS among.", "`labels_key`"
    if not sequences:
        return "the labels are not token sequences (one value per row: a classifier).", None
    if not has_mask and set(ids.pad) & set(ids.eos):
        reason = (
            "the pad id is the EOS id and the batches have no attention mask, so a real EOS cannot be told from "
            "padding."
        )
        return reason, "`mask_key`"
    return None


def batch_aside(
    ids: SpecialIds, input_ids: Tensor, mask: Tensor | None, labels: Tensor | None, encoder_decoder: bool
) -> tuple[bool, tuple[str, str | None] | None]:
    """Whether a batch's labels align with its ids, and why ``TFD124``'s count cannot use it (None: it can)."""
    aligned, sequences = label_layout(input_ids, labels, encoder_decoder)
    aside = eos_count_aside(ids, has_labels=labels is not None, sequences=sequences, has_mask=mask is not None)
    return aligned, aside


# ------------------------------------------------------------------------------------------------------------- readings


@dataclass(frozen=True)
class TokenCounts:
    """How often one special id occurs among the real inputs (not the first of a row) and the supervised labels."""

    inputs: float = 0.0
    supervised: float = 0.0


@dataclass(frozen=True)
class SpecialCounts:
    """:func:`~lightning_tfdebug.callbacks.batch_guard.statistics.special_token_statistics` on the host, by name: the
    counts of one batch, or their sums over batches (``+``)."""

    real_tokens: float = 0.0
    supervised: float = 0.0
    aligned_supervised: float = 0.0
    identity_matches: float = 0.0
    shift_matches: float = 0.0
    tokens: dict[int, TokenCounts] = field(default_factory=dict)  # special id -> its counts

    @classmethod
    def of(cls, host: Mapping[str, Any], ids: Sequence[int]) -> SpecialCounts:
        """From the statistics' fields on the host (``in_inputs`` / ``supervised_ids``: one count per id of ``ids``)."""
        tokens = {t: TokenCounts(a, b) for t, a, b in zip(ids, host["in_inputs"], host["supervised_ids"], strict=True)}
        return cls(
            real_tokens=host["real_tokens"],
            supervised=host["supervised"],
            aligned_supervised=host["aligned_supervised"],
            identity_matches=host["identity_matches"],
            shift_matches=host["shift_matches"],
            tokens=tokens,
        )

    def __add__(self, other: SpecialCounts) -> SpecialCounts:
        keys = [*self.tokens, *(t for t in other.tokens if t not in self.tokens)]
        zero = TokenCounts()
        tokens = {
            t: TokenCounts(
                self.tokens.get(t, zero).inputs + other.tokens.get(t, zero).inputs,
                self.tokens.get(t, zero).supervised + other.tokens.get(t, zero).supervised,
            )
            for t in keys
        }
        return SpecialCounts(
            self.real_tokens + other.real_tokens,
            self.supervised + other.supervised,
            self.aligned_supervised + other.aligned_supervised,
            self.identity_matches + other.identity_matches,
            self.shift_matches + other.shift_matches,
            tokens,
        )

    def of_ids(self, ids: Sequence[int]) -> TokenCounts:
        """The counts of ``ids`` together (several EOS ids)."""
        return TokenCounts(sum(self.tokens[t].inputs for t in ids), sum(self.tokens[t].supervised for t in ids))


# ------------------------------------------------------------------------------------------------------------- the rule


PAD_IS_EOS_MESSAGE = (
    " The pad id is the EOS id ({pad}): a collator that masks labels where labels == pad_id (Hugging Face "
    "DataCollatorForLanguageModeling(mlm=False) with tokenizer.pad_token = tokenizer.eos_token) masks every real EOS "
    "along with the padding."
)
PAD_IS_EOS_HINT = (
    "Mask padding by position, not by id: labels[attention_mask == 0] = -100 (e.g. a collator of your own after "
    "tokenizer.pad), or give the tokenizer a pad token of its own (tokenizer.add_special_tokens({'pad_token': "
    "'<pad>'}) and model.resize_token_embeddings(len(tokenizer)))."
)


PAD_IS_EOS_HINT = (
    "Mask padding by position, not by id: labels[attention_mask == 0] = -100 (e.g. a collator of your own after "
    "tokenizer.pad), or give the tokenizer a pad token of its own (tokenizer.add_special_tokens({'pad_token': "
    "'<pad>'}) and model.resize_token_embeddings(len(tokenizer)))."
)


TFD124 = Rule(
    "TFD124",
    "warning",
    "BatchGuard",
    title="the end-of-sequence token occurs in the inputs and is never supervised",
    headline="end-of-sequence token {eos_id} in the inputs is never supervised",
    trigger=(
        "over the first `special_token_batches` checked batches of a causal LM or a decoder's targets, "
        "`min_eos_expected` supervised EOS are expected from the inputs and none is"
    ),
    details=(
        "Over the first `special_token_batches` (default 8; 0 turns it off) value-checked batches: the EOS ids (from "
        "`eos_id`, `tokenizer`, a `tokenizer` attribute of the DataModule or LightningModule, or the model's Hugging "
        "Face config) are counted among the real input tokens (mask 1, each row's first real token left out) and the "
        "supervised labels. Fires when no supervised label is EOS while the EOS count in the inputs times the "
        "supervised share of the tokens (at most 1) reaches `min_eos_expected` (default 8), and the labels are a "
        "causal LM's (aligned with the ids, equal to the id at the same or next position for at least 80% of the "
        "supervised ones) or a decoder's targets (not aligned with the ids). Masked-LM labels (about 10% match) are "
        "left alone. The message names the collator pattern when the pad id is the EOS id. Stands aside once (info) "
        "without an EOS id, token labels, label sequences, or, with pad id = EOS id, an attention mask."
    ),
    hint=(
        "Find where the labels lose the EOS: a collator that masks by id (labels == pad_id while pad id == EOS id, as "
        "DataCollatorForLanguageModeling with tokenizer.pad_token = tokenizer.eos_token does), a completion-only mask "
        "that ends before the EOS. Mask padding by position (attention_mask == 0) or give the tokenizer a pad token "
        "of its own."
    ),
    reason="evidence of harm in this run: the model is never taught to end a sequence",
    message=(
        "Over the first {batches} checked batches the end-of-sequence token {eos_id} occurs {eos_in_inputs:.0f} times "
        "among the {inputs} and is never supervised: none of the {supervised_labels:.0f} supervised labels in "
        "{labels_at} is EOS (about {expected_supervised:.0f} expected at this data's supervised share of "
        "{share:.0%}). The model never learns to stop: it generates until the length limit.{collator}"
    ),
)


def labels_kind(totals: SpecialCounts, aligned: bool) -> str:
    """``"causal"``, ``"masked"`` (aligned labels matching the ids, or their next ones, for under
    :data:`CAUSAL_MATCH` of the supervised ones) or ``"targets"`` (a decoder's, not aligned with the ids)."""
    if not aligned:
        return "targets"
    match = (
        max(totals.identity_matches, totals.shift_matches) / totals.aligned_supervised
        if totals.aligned_supervised
        else 0.0
    )
    return "causal" if match >= CAUSAL_MATCH else "masked"


def eos_never_supervised(
    totals: SpecialCounts,
    ids: SpecialIds,
    *,
    aligned: bool,
    batches: int,
    min_expected: float,
    labels_key: str | None,
    has_mask: bool,
) -> Verdict | None:
    """``TFD124`` from the counts summed over ``batches``: EOS is expected among the labels (its count among the real
    inputs times the supervised share reaches ``min_expected``) where it is a target, and no label is EOS."""
    eos = totals.of_ids(ids.eos)
    layout = labels_kind(totals, aligned)
    share = min(1.0, totals.supervised / totals.real_tokens) if totals.real_tokens else 0.0
    expected = eos.inputs * share
    if eos.supervised > 0 or layout == "masked" or expected < min_expected:
        return None
    pad_is_eos = bool(set(ids.pad) & set(ids.eos))
    evidence: dict[str, Any] = {
        "eos_id": ids.eos[0] if len(ids.eos) == 1 else list(ids.eos),
        "eos_source": ids.source,
        "eos_in_inputs": eos.inputs,
        "eos_supervised": eos.supervised,
        "supervised_labels": totals.supervised,
        "real_tokens": totals.real_tokens,
        "expected_supervised": expected,
        "batches": batches,
        "labels_layout": layout,
        "pad_is_eos": pad_is_eos,
    }
    for role in ("sep", "pad"):
        for token in getattr(ids, role):
            counts = totals.tokens[token]
            evidence[f"{role}_{token}"] = {"inputs": counts.inputs, "supervised": counts.supervised}
    return TFD124.verdict(
        evidence,
        hint=PAD_IS_EOS_HINT if pad_is_eos else None,
        share=share,
        inputs="real input tokens (attention mask 1)" if has_mask else "input tokens",
        labels_at=f"'{labels_key}'" if labels_key else "the labels",
        collator=PAD_IS_EOS_MESSAGE.format(pad=ids.pad[0]) if pad_is_eos else "",
    )


# --------------------------------------------------------------------------------------------------------------- memory


@dataclass
class SpecialTokenTally:
    """``TFD124``'s memory: the special-token counts summed over the first ``max_batches`` checked batches.

    Judged where EOS is a target: a causal LM's labels (aligned, matching the ids for :data:`CAUSAL_MATCH` of the
    supervised ones) or a decoder's targets; a masked LM's are left alone. Done at the first supervised EOS, at the
    finding, or after ``max_batches``.
    """

    ids: SpecialIds
    min_expected: float = 8.0
    max_batches: int = 8
    totals: SpecialCounts = field(default_factory=SpecialCounts)
    batches: int = 0
    aligned: bool = True
    done: bool = False

    def update(self, counts: SpecialCounts, aligned: bool) -> None:
        """Count one batch (``aligned``: its labels align with the ids)."""
        self.totals = self.totals + counts if self.batches else counts
        self.batches += 1
        self.aligned = self.aligned and aligned

    def add(self, host: Mapping[str, Any], aligned: bool, labels_key: str | None, has_mask: bool) -> Verdict | None:
        """Count one batch's statistics (``host``: their fields on the host) and decide."""
        if self.done:
            return None
        self.update(SpecialCounts.of(host, self.ids.ordered()), aligned)
        if self.totals.of_ids(self.ids.eos).supervised > 0:  # EOS is taught: nothing more to watch
            self.done = True
            return None
        found = eos_never_supervised(
            self.totals,
            self.ids,
            aligned=self.aligned,
            batches=self.batches,
            min_expected=self.min_expected,
            labels_key=labels_key,
            has_mask=has_mask,
        )
        self.done = found is not None or self.batches >= self.max_batches
        return found

    def statistics(
        self, ids: Tensor, mask: Tensor | None, labels: Tensor, ignore_index: int, aligned: bool
    ) -> dict[str, Tensor]:
        """One batch's :func:`~lightning_tfdebug.callbacks.batch_guard.statistics.special_token_statistics` on its
        device, by name."""
        with torch.no_grad():
            return special_token_statistics(
                ids, mask, labels, self.ids.ordered(), ignore_index=ignore_index, labels_aligned=aligned
            )
