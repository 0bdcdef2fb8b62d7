"""Per-row fingerprints of a batch, for the train/validation leakage check (:mod:`.leakage_checks`): torch kernels on
the batch's own device, no host sync (the values reach the host with a transfer the caller already makes).

A row is one sample of the batch (its first dimension). Its fingerprint is taken over its **real** positions only
(the attention mask's non-zero entries, in order), so the same sample padded to another width, on the left or on the
right, in a batch of another size, has the same fingerprint. Two independent 31-bit hashes make one 62-bit key
(:func:`row_keys`): a false match between two different rows is about 1 in ``2**62``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_tfdebug.primitives.batch import StepBatch

_BASE = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64, the ring int64 arithmetic wraps in
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # a 64-bit finaliser's multipliers (SplitMix64)
_POWERS: dict[tuple[torch.device, int], tuple[Tensor, Tensor]] = {}
_HALF = 2**31 - 1


def _signed(value: int) -> int:
    """``value`` modulo ``2**64`` as a signed int64."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


MAX_FEATURE_VALUES = 256
"""Values per row hashed for a field other than token ids."""

MIN_ROW_TOKENS = 8
"""A row is compared only with at least this many real positions (shorter rows recur naturally: "Thank you.")."""

MIN_DISTINCT_TOKENS = 4
"""A row is compared only with at least this many different values among its real positions (all-padding rows, rows
of special tokens and short repeated patterns recur in any healthy data)."""


def _powers(device: torch.device, length: int) -> tuple[Tensor, Tensor]:
    """``(n,)`` int64 tables, ``n >= length``: the base's powers ``b**p`` and their inverses ``b**-p`` modulo ``2**64``;
    computed on the host once per device and size (powers of two: a few per run), then copied over (a host-to-device
    copy from pageable memory, which waits for the device: once per size, never again)."""
    capacity = 1 << max(6, (max(length, 1) - 1).bit_length())
    found = _POWERS.get((device, capacity))
    if found is None:
        if len(_POWERS) > 32:
            _POWERS.clear()
        inverse = pow(_BASE, -1, 2**64)
        powers = [_signed(pow(_BASE, p, 2**64)) for p in range(capacity)]
        inverses = [_signed(pow(inverse, p, 2**64)) for p in range(capacity)]
        found = (
            torch.tensor(powers, dtype=torch.int64).to(device),
            torch.tensor(inverses, dtype=torch.int64).to(device),
        )
        _POWERS[(device, capacity)] = found
    return found


def _as_int64_rows(x: Tensor) -> Tensor:
    """``x`` as ``(rows, positions)`` int64: integers as they are, floating values by their bit pattern."""
    flat = x.detach().reshape(x.shape[0], -1) if x.ndim >= 1 else x.detach().reshape(1, 1)
    if flat.is_floating_point() or flat.is_complex():
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
        flat = flat.contiguous().view(bits)
    return flat.to(torch.int64)


def row_keys(rows: Tensor, mask: Tensor | None) -> Tensor:
    """``(rows,)`` int64 hashes of each row's real positions (``mask`` non-zero, or every position when ``mask`` is
    None), in order; on ``rows``' device, no sync. :func:`key_halves` makes them keys.

    ``sum((x_p + 1) * b**p) * b**-s`` over the real positions ``p`` (``s``: the row's first), in int64 arithmetic,
    which wraps modulo ``2**64`` where the odd base ``b`` is invertible: the polynomial of the real values from the
    first, so padding on either side and the batch's width do not change it (``+ 1``: a trailing id 0 counts).
    """
    flat = _as_int64_rows(rows)
    width = flat.shape[1]
    powers, inverses = _powers(flat.device, width)
    # int64 products and sums wrap around modulo 2**64: the ring the hash is defined in, the same on every device
    terms = (flat + 1) * powers[:width]
    if mask is None:
        return terms.sum(-1)
    real = mask.reshape(flat.shape) != 0
    first = real.to(torch.int8).argmax(-1)  # the first real position (0 for an all-padding row)
    return (terms * real).sum(-1) * inverses[first]


def key_halves(hashes: Tensor) -> Tensor:
    """``(n, 2)`` int64: :func:`row_keys`' hashes mixed by a 64-bit finaliser (SplitMix64's, so every bit of the
    polynomial reaches the bits kept) and cut into two 31-bit halves, exact in the float64 of a host transfer."""
    h = hashes
    for multiplier in _MIX:
        h = (h ^ ((h >> 31) & (2**33 - 1))) * _signed(multiplier)
    return torch.stack([(h >> 33) & _HALF, (h >> 2) & _HALF], -1)


def informative(rows: Tensor, mask: Tensor | None) -> Tensor:
    """``(rows,)`` bool: the row has :data:`MIN_ROW_TOKENS` real positions and :data:`MIN_DISTINCT_TOKENS` different
    values among them (one sort per row, on the device, no sync)."""
    flat = _as_int64_rows(rows)
    real = torch.ones_like(flat, dtype=torch.bool) if mask is None else mask.reshape(flat.shape) != 0
    floor = torch.iinfo(torch.int64).min  # padding sorts first and is not counted
    ordered = torch.where(real, flat, torch.full_like(flat, floor)).sort(-1).values
    distinct = (ordered[:, :1] != floor).sum(-1) + (ordered[:, 1:] != ordered[:, :-1]).sum(-1)
    return (real.sum(-1) >= MIN_ROW_TOKENS) & (distinct >= MIN_DISTINCT_TOKENS)


@dataclass(frozen=True)
class RowField:
    """What a batch's rows are compared on: the field's name, its rows and their mask of real positions."""

    name: str  # "input_ids" for the token ids, else the field's path in the batch
    rows: Tensor
    mask: Tensor | None


def row_field(
    view: StepBatch, like: str | None, ignore_index: int, labels_aligned: bool, pad_ids: tuple[int, ...] = ()
) -> RowField | None:
    """The field of ``view`` that rows are compared on, None when it has none.

    The token ids when the batch has them and ``like`` is None or ``"input_ids"``: their real positions by the
    attention mask (without one: the positions not holding one of ``pad_ids``, the run's padding ids), and where
    aligned labels (same shape, not an encoder-decoder's targets) are not ``ignore_index``, the label in place of the
    id (a masked LM's masked positions get their original token back, so a row masked differently in another batch
    keeps its key; a causal LM's labels equal its ids there). Else the tensor leaf at path ``like`` (another
    structure compared on the field it shares), or, with ``like`` None, the first tensor leaf with a batch dimension.
    """
    ids, mask, labels = view.token_fields()
    if ids is not None and ids.ndim >= 1 and like in (None, "input_ids"):
        content = ids
        if labels is not None and labels_aligned and labels.shape == ids.shape:
            content = torch.where(labels != ignore_index, labels.to(ids.dtype), ids)
        if mask is None and pad_ids:  # a batch without a mask, padded: the same row as in a batch with one
            mask = ~torch.isin(ids, torch.tensor(pad_ids, device=ids.device, dtype=ids.dtype))
        return RowField("input_ids", content, mask)
    leaves = view.fields.leaves
    if like is not None:
        value = leaves.get(like)
        return _prefix(like, value) if isinstance(value, Tensor) and value.ndim >= 1 else None
    for path, value in leaves.items():
        if isinstance(value, Tensor) and value.ndim >= 1 and value.numel() > 0:
            return _prefix(path, value)
    return None


def _prefix(path: str, value: Tensor) -> RowField:
    """A field other than token ids, each row read by its first :data:`MAX_FEATURE_VALUES` values (an image or a
    feature vector is told apart by them; the cost on the training step stays that of a short token row)."""
    return RowField(path, value.detach().reshape(value.shape[0], -1)[:, :MAX_FEATURE_VALUES], None)
