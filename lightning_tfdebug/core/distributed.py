"""How parameters lie over the ranks, and the one-flag collective of the hot path.

A sharded parameter's contribution to a summed statistic is weighted by ``1 / replicas`` (:func:`plan_sharding`), so
summing over the world counts every element once; DDP and one process need no collective at all. What crosses ranks
is declared by name in :mod:`lightning_tfdebug.core.reduction` (``docs/architecture.md``, ``docs/collectives.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tfdebug.primitives.tensors import DTensor


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
