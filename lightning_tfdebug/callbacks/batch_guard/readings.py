"""BatchGuard's readings: where a batch's fields are (:class:`BatchPaths`), the value rules it is held to
(:class:`ValueRules`), what the data loader says of an epoch (:class:`EpochData`), and the limits its memory keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.functional.batches import token_statistics

STREAM_REPEAT_WINDOW = 16  # from a stream, a repeat counts only this close (a stream may cycle its data)
MAX_EPOCH_PRINTS = 100_000  # fingerprints kept per epoch for TFD121 (a few MB at most)
MIN_EXCESS_REPEATS = 3  # TFD123 needs at least this many batches beyond the distinct ones the data allows


# ------------------------------------------------------------------------------------------------ readings
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
