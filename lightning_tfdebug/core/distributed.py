"""Distributed reductions shared by every callback.

Every rank reduces its local statistics to a small vector of "sum" slots and "max" slots, and one collective turns
the vectors of all ranks into global values. A sharded parameter's contribution to a sum slot is weighted by
``1 / replicas`` (:func:`plan_sharding`), so summing over the world counts every element once; DDP and one process
need no collective at all (see ``docs/distributed.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

try:  # DTensor moved out of the private namespace in torch 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_forward_module"})


def clean_param_name(name: str) -> str:
    """Drop the name segments that wrappers insert: FSDP1, activation checkpointing, ``torch.compile``, Fabric, and
    DDP's leading ``module``. A trailing dot (module prefixes such as ``"blocks."``) is kept."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_tensor(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` stored on this rank (the local shard of a DTensor, else the tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class ShardingPlan:
    """How the parameters of one model are laid out over the ranks.

    Attributes:
        sharded: True when at least one parameter is sharded, i.e. reductions need a collective.
        weights: per parameter (same order as given), the factor its sum-type statistics are multiplied by before
            the collective (``1.0`` when ``sharded`` is False).
        world_size: number of ranks taking part in the collective.
    """

    sharded: bool
    weights: tuple[float, ...]
    world_size: int


def _fsdp1_group_size(module: torch.nn.Module | None) -> int | None:
    """Size of the FSDP1 process group, or None when ``module`` holds no FSDP1 unit."""
    if module is None:
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None
    for sub in module.modules():
        if isinstance(sub, FullyShardedDataParallel):
            group = getattr(sub, "process_group", None)
            return dist.get_world_size(group) if group is not None else world_size()
    return None


def plan_sharding(params: Iterable[Tensor], root: torch.nn.Module | None = None) -> ShardingPlan:
    """Work out, once per fit, how each parameter's statistics must be weighted before reduction.

    Args:
        params: the parameters that will be reduced, in the order the statistic vectors will use.
        root: the model; used to find FSDP1 units (whose parameters are plain tensors).
    """
    params = list(params)
    n_ranks = world_size()
    fsdp1_group = _fsdp1_group_size(root)
    replicas: list[float] = []
    any_sharded = False
    for p in params:
        if isinstance(p, DTensor):
            shards = 1
            for dim, placement in enumerate(p.placements):
                if placement.is_shard() or placement.is_partial():
                    shards *= p.device_mesh.size(dim)
            any_sharded = any_sharded or shards > 1
            replicas.append(n_ranks / shards)
        elif fsdp1_group is not None and fsdp1_group > 1:
            any_sharded = True
            replicas.append(n_ranks / fsdp1_group)
        else:
            replicas.append(float(n_ranks))
    if not any_sharded or n_ranks == 1:
        return ShardingPlan(sharded=False, weights=tuple(1.0 for _ in params), world_size=n_ranks)
    return ShardingPlan(sharded=True, weights=tuple(1.0 / r for r in replicas), world_size=n_ranks)


def packed_reduce(sums: Tensor, maxes: Tensor | None = None, *, collective: bool = True) -> tuple[Tensor, Tensor]:
    """Reduce many scalars across ranks with one collective.

    Args:
        sums: 1-D float tensor of values to add up over ranks (already weighted, see :class:`ShardingPlan`).
        maxes: 1-D float tensor of values to take the maximum of over ranks (may be empty or None).
        collective: False skips the collective (replicated layout, or a single process) and returns the inputs.

    Returns:
        ``(global_sums, global_maxes)`` on the device of ``sums``.

    Collective: one ``all_gather`` of the packed ``[sums, maxes]``; every rank must call it on the same step with
    vectors of the same length.
    """
    if maxes is None:
        maxes = sums.new_zeros(0)
    if not collective or world_size() == 1:
        return sums, maxes
    packed = torch.cat([sums.float(), maxes.float()])
    gathered = [torch.empty_like(packed) for _ in range(world_size())]
    dist.all_gather(gathered, packed)
    stacked = torch.stack(gathered)  # (world, n_sums + n_maxes)
    n = sums.numel()
    return stacked[:, :n].sum(0), stacked[:, n:].amax(0) if maxes.numel() else maxes


def all_gather_vector(values: Tensor) -> Tensor:
    """Gather one equally-sized 1-D vector from every rank; returns ``(world_size, n)``. One collective."""
    if world_size() == 1:
        return values.unsqueeze(0)
    gathered = [torch.empty_like(values) for _ in range(world_size())]
    dist.all_gather(gathered, values.contiguous())
    return torch.stack(gathered)


def gradients_replicated(strategy_model: torch.nn.Module | None, params: Iterable[Tensor]) -> bool:
    """Whether, after backward, every rank holds the same full gradients (torch's ``DistributedDataParallel``, no
    DTensor shard), so a flag computed from them needs no collective. False in a single process and under any
    sharding or unknown wrapper."""
    if world_size() == 1 or not isinstance(strategy_model, torch.nn.parallel.DistributedDataParallel):
        return False
    return not any(isinstance(p, DTensor) for p in params)


def any_rank(flag: Tensor) -> Tensor:
    """The maximum of a one-element float ``flag`` over every rank (``flag`` itself in a single process).

    Collective: one one-element ``all_reduce``; every rank must call it on the same step."""
    flag = flag.detach().reshape(1).to(torch.float32, copy=True)
    if world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag
