"""Tensor helpers every layer uses: a DTensor's local shard and a parameter's name without wrapper segments (pure)."""

from __future__ import annotations

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


def local_tensor(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` stored on this rank (the local shard of a DTensor, else the tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
