"""BatchGuard's rules on special tokens: the ids learned from the tokenizer and collator, and an end-of-sequence
token that is never supervised (``TFD124``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.batches import special_token_statistics
from lightning_tfdebug.functional.special_ids import SpecialIds
from lightning_tfdebug.functional.verdicts import Rule, Verdict

# ------------------------------------------------------------------------------------------------ special tokens
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


TFD124 = Rule(
    "TFD124",
    "warning",
    "BatchGuard",
    title="the end-of-sequence token occurs in the inputs and is never supervised",
    trigger=(
        "over the first `special_token_batches` checked batches of a causal LM or a decoder's targets, "
        "`min_eos_expected` supervised EOS are expected from the inputs and none is"
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


def _added(total: Any, value: Any) -> Any:
    """``total + value`` for a count or, element by element, for a list of counts (``total`` None: the first)."""
    if total is None:
        return list(value) if isinstance(value, list) else value
    return [a + b for a, b in zip(total, value, strict=True)] if isinstance(value, list) else total + value


@dataclass
class SpecialTokenTally:
    """``TFD124``: an end-of-sequence token present among the real inputs and never supervised.

    Sums :func:`~lightning_tfdebug.functional.batches.special_token_statistics` over the first ``max_batches`` checked
    batches. Judged where EOS is a target: a causal LM's labels (aligned, matching the ids for :data:`CAUSAL_MATCH` of
    the supervised ones) or a decoder's targets; a masked LM's are left alone. EOS must be expected among the labels
    (its count among the real inputs times the supervised share, ``min(1, supervised / real)``, reaches
    ``min_expected``) while not one label is EOS. Done at the first supervised EOS or after ``max_batches``.
    """

    ids: SpecialIds
    min_expected: float = 8.0
    max_batches: int = 8
    totals: dict[str, Any] = field(default_factory=dict)
    batches: int = 0
    aligned: bool = True
    done: bool = False

    def add(self, host: Mapping[str, Any], aligned: bool, labels_key: str | None, has_mask: bool) -> Verdict | None:
        """Count one batch's statistics (``host``: the fields of
        :func:`~lightning_tfdebug.functional.batches.special_token_statistics` on the host, the vectors as lists);
        ``aligned``: its labels align with the ids."""
        if self.done:
            return None
        self.totals = {k: _added(self.totals.get(k), v) for k, v in host.items()}
        self.batches += 1
        self.aligned = self.aligned and aligned
        t = self.totals
        counts = dict(zip(self.ids.ordered(), zip(t["in_inputs"], t["in_labels"], strict=True), strict=True))
        real, supervised, aligned_supervised = t["real_tokens"], t["supervised"], t["aligned_supervised"]
        identity, shift = t["identity_matches"], t["shift_matches"]
        eos_inputs = sum(counts[t][0] for t in self.ids.eos)
        eos_supervised = sum(counts[t][1] for t in self.ids.eos)
        if eos_supervised > 0:
            self.done = True
            return None
        match = max(identity, shift) / aligned_supervised if aligned_supervised else 0.0
        layout = ("causal" if match >= CAUSAL_MATCH else "masked") if self.aligned else "targets"
        share = min(1.0, supervised / real) if real else 0.0
        expected = eos_inputs * share
        if layout == "masked" or expected < self.min_expected:
            self.done = self.batches >= self.max_batches
            return None
        self.done = True
        pad_is_eos = bool(set(self.ids.pad) & set(self.ids.eos))
        evidence: dict[str, Any] = {
            "eos_id": self.ids.eos[0] if len(self.ids.eos) == 1 else list(self.ids.eos),
            "eos_source": self.ids.source,
            "eos_in_inputs": eos_inputs,
            "eos_supervised": eos_supervised,
            "supervised_labels": supervised,
            "real_tokens": real,
            "expected_supervised": expected,
            "batches": self.batches,
            "labels_layout": layout,
            "pad_is_eos": pad_is_eos,
        }
        for role in ("sep", "pad"):
            for token in getattr(self.ids, role):
                evidence[f"{role}_{token}"] = {"inputs": counts[token][0], "supervised": counts[token][1]}
        return TFD124.verdict(
            evidence,
            hint=PAD_IS_EOS_HINT if pad_is_eos else None,
            share=share,
            inputs="real input tokens (attention mask 1)" if has_mask else "input tokens",
            labels_at=f"'{labels_key}'" if labels_key else "the labels",
            collator=PAD_IS_EOS_MESSAGE.format(pad=self.ids.pad[0]) if pad_is_eos else "",
        )

    def statistics(
        self, ids: Tensor, mask: Tensor | None, labels: Tensor, ignore_index: int, aligned: bool
    ) -> dict[str, Tensor]:
        """One batch's :func:`~lightning_tfdebug.functional.batches.special_token_statistics` on its device."""
        with torch.no_grad():
            return special_token_statistics(
                ids, mask, labels, self.ids.ordered(), ignore_index=ignore_index, labels_aligned=aligned
            )


BLOCK = ("TFD101", "TFD129")
"""The codes reserved for BatchGuard's rules."""

RULES: tuple[Rule, ...] = (TFD124,)
"""The rules decided in this module, in code order."""
