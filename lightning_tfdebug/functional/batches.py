"""Fingerprints of batches: an order-sensitive hash of a tensor's values, on the host for a CPU tensor or on its
device with no sync. Shared by BatchGuard (repeated batches) and PerRankLogger (the batch each rank trained on)."""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

from lightning_tfdebug.primitives.batch import host_array

_HASH_MODULUS = 2_147_483_647  # 2**31 - 1: a fingerprint fits exactly in a float64 slot of a packed collective
_HASH_MULTIPLIER = 1_103_515_245
#: per length and device: the position weights of the fingerprint, and the constant its sum adds
_WEIGHTS: dict[tuple[int, torch.device], tuple[Tensor, int]] = {}


def _fingerprint_weights(numel: int, device: torch.device) -> tuple[Tensor, int]:
    key = (numel, device)
    found = _WEIGHTS.get(key)
    if found is None:
        if len(_WEIGHTS) > 64:  # many distinct lengths (unpadded batches): keep the cache small
            _WEIGHTS.clear()
        positions = torch.arange(1, numel + 1, device=device, dtype=torch.int64)
        weights = (positions * _HASH_MULTIPLIER + 12345) % _HASH_MODULUS
        # sum((x + 1) * w) + n == sum(x * w) + (sum(w) + n): the constant part, computed once (host read, cached)
        found = _WEIGHTS[key] = (weights, int(weights.sum()) + numel)
    return found


def host_fingerprint(ids: Tensor) -> int | None:
    """The fingerprint of a CPU tensor, the CRC-32 of its bytes in ``[0, 2**31 - 1)`` (no torch kernel on the hot
    path); None when NumPy cannot read it. Its numbers differ from :func:`device_fingerprint`'s: a run uses one kind.
    """
    array = host_array(ids)
    if array is None:
        return None
    if not array.flags.c_contiguous:
        array = array.copy()  # a strided view: its elements in order (the CRC reads one contiguous buffer)
    return zlib.crc32(array) % _HASH_MODULUS


def batch_fingerprint(ids: Tensor) -> Tensor:
    """An order-sensitive hash of a tensor's values as an int64 scalar in ``[0, 2**31 - 1)`` (collisions about 1 in
    2**31): :func:`host_fingerprint` for a CPU tensor, else :func:`device_fingerprint` (no sync)."""
    host = host_fingerprint(ids.detach())
    if host is not None:
        return torch.tensor(host)
    return device_fingerprint(ids)


def device_fingerprint(ids: Tensor) -> Tensor:
    """The fingerprint of :func:`batch_fingerprint` computed by torch kernels on ``ids``' device (any device)."""
    flat = ids.detach().reshape(-1)
    if flat.is_floating_point():
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
        flat = flat.contiguous().view(bits)
    flat = flat.to(torch.int64)
    weights, constant = _fingerprint_weights(flat.numel(), flat.device)
    # int64 products and sums may wrap around: harmless for a hash, and identical on every rank
    return ((flat * weights).sum() + constant) % _HASH_MODULUS


def combine_fingerprints(a: Tensor | None, b: Tensor) -> Tensor:
    """Fold fingerprint ``b`` into ``a`` (order-sensitive), for the micro-batches of one optimizer step."""
    if a is None:
        return b
    return (a * 31 + b) % _HASH_MODULUS
