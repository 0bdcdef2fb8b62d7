"""Per-sample attribution of a loss spike: per-row losses from a model call's logits, and each row's token statistics.

Pure tensor functions; SpikeGuard runs them on a spike step only (host reads there are deliberate).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tfdebug.functional.spike_checks import SampleStats, carriers, median_of


def targets_for(ids: Tensor, labels: Tensor | None, mask: Tensor | None, ignore_index: int) -> Tensor:
    """The targets the logits are scored on: the batch's labels, else its ids with padding set to ``ignore_index``."""
    if labels is not None:
        return labels
    if mask is not None and mask.shape == ids.shape:
        return ids.masked_fill(mask == 0, ignore_index)
    return ids


def per_sample_losses(logits: Tensor, targets: Tensor, shift: int, ignore_index: int) -> Tensor:
    """Mean token cross-entropy of each row, float32 ``(batch,)``: position ``t`` scored against target ``t + shift``
    (rows without a scored token: nan)."""
    logits = logits.float()
    t = min(logits.shape[1], targets.shape[1])
    logits, targets = logits[:, : t - shift], targets[:, shift:t]
    token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index=ignore_index, reduction="none"
    ).view(targets.shape)
    scored = (targets != ignore_index).float()
    return (token * scored).sum(1) / scored.sum(1)


def sample_stats(
    losses: Sequence_f,
    ids: Tensor | None,
    mask: Tensor | None,
    dataset_indices: list[int] | None,
    usual_max_id: int | None,
) -> tuple[list[SampleStats], float | None]:
    """The rows carrying the excess (:func:`carriers`) with their token statistics, and their share of the batch's
    excess loss over its median."""
    rows = carriers(losses)
    median = median_of(losses)
    total = sum(max(v - median, 0.0) for v in losses)
    share = sum(max(losses[r] - median, 0.0) for r in rows) / total if total > 0 else None
    out = []
    for r in rows:
        s = SampleStats(row=r, loss=float(losses[r]), excess=float(losses[r] - median))
        if dataset_indices is not None and r < len(dataset_indices):
            s.dataset_index = int(dataset_indices[r])
        if ids is not None and ids.ndim == 2 and r < ids.shape[0]:
            row = ids[r]
            if mask is not None and mask.shape == ids.shape:
                row = row[mask[r] != 0]
            n = int(row.numel())
            distinct = int(torch.unique(row).numel()) if n else 0
            s.length, s.distinct_ids = n, distinct
            s.repeated_share = 1.0 - distinct / n if n else None
            if usual_max_id is not None:
                s.ids_out_of_range = int((row > usual_max_id).sum())
        out.append(s)
    return out, share


Sequence_f = Any  # a sequence of floats (a list of host losses)


def usual_max_id(ids: Tensor, mask: Tensor | None, skip_rows: list[int]) -> int | None:
    """The largest id in the batch's other rows (the run's usual range as this batch shows it); None if none."""
    keep = [r for r in range(ids.shape[0]) if r not in set(skip_rows)]
    if not keep:
        return None
    rows = ids[keep]
    if mask is not None and mask.shape == ids.shape:
        rows = rows[mask[keep] != 0]
    return int(rows.max()) if rows.numel() else None


def dataset_indices_of(batch: Any) -> list[int] | None:
    """The dataset indices a batch carries (a mapping with ``index``, ``idx``, ``indices`` or ``sample_idx``)."""
    if isinstance(batch, dict):
        for key in ("index", "idx", "indices", "sample_idx", "sample_index"):
            value = batch.get(key)
            if isinstance(value, Tensor) and value.ndim == 1:
                return [int(v) for v in value.tolist()]
            if isinstance(value, list) and all(isinstance(v, int) for v in value):
                return list(value)
    return None
