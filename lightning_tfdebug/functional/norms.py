"""Grouped norms of many tensors, fused and on the device. No Trainer, no host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def per_tensor_norms(tensors: Sequence[Tensor]) -> Tensor:
    """L2 norm of each tensor, in fp32, as one 1-D tensor (one fused ``_foreach_norm`` per device/dtype group)."""
    if not tensors:
        return torch.zeros(0)
    # memory: CUDA reads each tensor in place; the CPU kernel converts a bf16/fp16 tensor to fp32 for its norm, one
    # tensor at a time (at most the largest such tensor at 4 bytes per element, for the moment of its norm)
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
    device = norms[0].device
    if all(n.device == device for n in norms):  # the usual case: no per-tensor copy call
        return torch.stack(norms)
    return torch.stack([n.to(device) for n in norms])


def group_sums(values: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Sum ``values`` into ``n_groups`` buckets given each value's bucket ``index``."""
    return values.new_zeros(n_groups).index_add_(0, index, values)


def grouped_sq_norms(
    tensors: Sequence[Tensor],
    index: Tensor,
    n_groups: int,
    weights: Tensor | None = None,
    norms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Weighted sum of squared L2 norms per group, and the per-tensor non-finite flags.

    Args:
        tensors: local tensors (shards under FSDP); empty tensors contribute zero.
        index: ``(len(tensors),)`` long tensor, the group of each tensor.
        n_groups: number of groups.
        weights: ``(len(tensors),)`` factors applied to each squared norm (``1/replicas`` under sharding).
        norms: the per-tensor norms of ``tensors`` when already computed (:func:`step_norms`).

    Returns:
        ``(group_sq, nonfinite)``: ``(n_groups,)`` sums of squares, and ``(len(tensors),)`` float flags that are 1.0
        where a tensor holds an inf or nan.
    """
    if norms is None:
        norms = per_tensor_norms(tensors)
    sq = norms.square()
    if weights is not None:
        sq = sq * weights
    nonfinite = (~torch.isfinite(norms)).float()
    return group_sums(sq, index, n_groups), nonfinite
