"""What BatchGuard reads of a batch besides its findings' decisions: where its fields are, what its values are
compared against, the name a finding gives it, where its fields were found, the logged keys, and decoded examples."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.callbacks.batch_guard.statistics import token_statistics
from lightning_tfdebug.primitives.batch import StepBatch


@dataclass(frozen=True)
class BatchPaths:
    """Where the ids, the attention mask and the labels of a batch are (``None``: the batch has none)."""

    input_ids: str | None
    attention_mask: str | None
    labels: str | None

    @classmethod
    def of(cls, paths: Mapping[str, str | None]) -> BatchPaths:
        """From :class:`~lightning_tfdebug.primitives.batch.BatchFields`' ``paths``."""
        return cls(paths.get("input_ids"), paths.get("attention_mask"), paths.get("labels"))


@dataclass(frozen=True)
class ValueRules:
    """What the value checks compare against."""

    vocab_size: int | None
    context: int | None
    ignore_index: int
    bos_id: int | None = None
    eos_id: int | None = None
    max_truncated_fraction: float = 0.5

    def statistics(
        self,
        ids: Tensor,
        mask: Tensor | None,
        labels: Tensor | None,
        position_ids: Tensor | None = None,
        labels_aligned: bool = True,
    ) -> Tensor:
        """One batch's :func:`~lightning_tfdebug.functional.batches.token_statistics` for these rules, on its device."""
        with torch.no_grad():
            return token_statistics(
                ids,
                mask,
                labels,
                vocab_size=self.vocab_size,
                ignore_index=self.ignore_index,
                bos_id=self.bos_id,
                eos_id=self.eos_id,
                max_length=self.context,
                position_ids=position_ids,
                labels_aligned=labels_aligned,
            )


@dataclass(frozen=True)
class BatchPlace:
    """Where a batch is in the run (the ``where`` of the messages is built from it only for a finding)."""

    batch_idx: int
    step: int
    epoch: int
    rank: int

    def name(self) -> str:
        """The batch a finding names."""
        return batch_name(self.batch_idx, self.step, self.epoch, self.rank)


def batch_name(batch_idx: int, step: int, epoch: int, rank: int) -> str:
    """The batch a finding names (the ``where`` of the messages)."""
    return f"Batch {batch_idx} (step {step}, epoch {epoch}, rank {rank})"


def fields_notice(paths: Mapping[str, str | None], leaves: Mapping[str, Any], input_key: str | None) -> str | None:
    """Where the first batch's fields were found, when the user should know (no ids, or ids under another name)."""
    ids = paths.get("input_ids")
    if ids is None:
        return (
            f"BatchGuard: no token ids in the first batch (keys: {sorted(leaves)}); the token, length and label checks "
            "are off, the schema checks stay on. Set `input_key` (and `labels_key`, `mask_key`)."
        )
    if ids != (input_key or "input_ids"):
        return (
            f"BatchGuard: token ids taken from '{ids}' and labels from '{paths.get('labels')}' (the batch has no "
            "'input_ids'); set `input_key` / `labels_key` if that is wrong."
        )
    return None


def batch_metrics(s: dict[str, float], rules: ValueRules, has_labels: bool) -> dict[str, float]:
    """The ``batch_guard/*`` keys from the unpacked statistics of one batch."""
    n, width = max(s["sequences"], 1.0), max(s["width"], 1.0)
    metrics = {
        "batch_guard/width": s["width"],
        "batch_guard/length_mean": s["length_sum"] / n,
        "batch_guard/pad_frac": s["pad_positions"] / (n * width),
    }
    if has_labels:
        metrics["batch_guard/ignored_frac"] = s["labels_ignored"] / max(s["labels_total"], 1.0)
    if rules.eos_id is not None and rules.context is not None:
        metrics["batch_guard/truncated_frac"] = s["truncated"] / n
    return metrics


def example_rows(ids: Tensor, labels: Tensor | None, count: int) -> tuple[list[list[int]], list[list[int]] | None]:
    """The first ``count`` rows of the ids (and labels) as host lists, for :func:`decoded_examples` (a host sync)."""
    rows = [t if t.ndim >= 2 else t.reshape(1, -1) for t in (ids, labels) if t is not None]
    k = min(count, rows[0].shape[0])
    return rows[0][:k].tolist(), rows[1][:k].tolist() if len(rows) > 1 else None


def decoded_examples(
    tokenizer: Any, rows: list[list[int]], label_rows: list[list[int]] | None, ignore_index: int, rank: int = 0
) -> list[str]:
    """Markdown lines showing each row decoded, and which of its positions the labels supervise (``·`` = ignored).

    Raises:
        Exception: whatever ``tokenizer.decode`` raises.
    """
    lines = [f"First {len(rows)} sequences of the first training batch (rank {rank}):", ""]
    for i, row in enumerate(rows):
        pieces = [tokenizer.decode([t]) for t in row]
        lines.append(f"**{i}** ({len(row)} tokens) input: `{tokenizer.decode(row)!r}`")
        if label_rows is not None:
            shown = "".join(p if lab != ignore_index else "·" * max(len(p), 1) for p, lab in zip(pieces, label_rows[i]))
            supervised = sum(lab != ignore_index for lab in label_rows[i])
            lines.append(f"  labels ({supervised} supervised, · = ignored): `{shown!r}`")
        lines.append("")
    return lines


@dataclass(frozen=True)
class KeptBatch:
    """The batch of the step, kept by reference (no copy) so that a forward that raises can be diagnosed."""

    view: StepBatch
    place: BatchPlace
    checked: bool  # its values were checked before the forward
