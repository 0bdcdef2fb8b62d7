"""Pure readings of training batches: schemas from host metadata (no sync), every value statistic of a batch as one
device vector (one transfer to the host), and fingerprints."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_tfdebug.primitives.batch import host_array

# ---------------------------------------------------------------------------------------------------- token statistics

STAT_NAMES: tuple[str, ...] = (
    "sequences",  # rows in the batch
    "width",  # padded sequence length
    "ids_out_of_range",  # input ids outside [0, vocab)
    "first_bad_id_row",  # row / column / value of the first out-of-range id (-1 when none)
    "first_bad_id_col",
    "first_bad_id_value",
    "ids_min",
    "ids_max",
    "mask_non_binary",  # mask entries that are neither 0 nor 1
    "first_bad_mask_value",  # the first of them (0 when none)
    "labels_total",
    "labels_ignored",
    "labels_out_of_range",  # labels outside [0, vocab) that are not ignore_index
    "first_bad_label_value",
    "pad_supervised",  # positions with mask 0 whose label is not ignore_index
    "pad_positions",
    "length_sum",  # sum of real (mask 1) lengths
    "length_sq_sum",
    "bos_missing",  # sequences whose first real token is not BOS
    "eos_multiple",  # sequences with more than one EOS
    "eos_then_tokens",  # sequences with a real token after their first EOS
    "truncated",  # sequences that fill max_length and hold no EOS
    "mask_hole_rows",  # rows whose real tokens are not one run at one end of the row (see mask_holes)
    "mask_holes",  # masked positions inside a row's text: between real tokens, or at the row's other end
    "mask_hole_row_tokens",  # real tokens in the rows with holes
    "holes_masked_everywhere",  # holes whose id is attended nowhere in the batch (a mask built from token ids)
    "holes_attended_in_row",  # holes whose id is attended elsewhere in the same row (a real token hidden)
    "first_hole_row",  # row / column / id of the first hole (-1 when none)
    "first_hole_col",
    "first_hole_id",
    "padding_id_min",  # smallest / largest id at the masked positions that are not holes (-1 when none)
    "padding_id_max",
    "position_resets",  # attended positions whose position id does not exceed an earlier one in the row (packing)
)


def token_statistics(
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    labels: Tensor | None = None,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    bos_id: int | None = None,
    eos_id: int | None = None,
    max_length: int | None = None,
    position_ids: Tensor | None = None,
    labels_aligned: bool = True,
    host_reads: bool | None = None,
) -> Tensor:
    """All value statistics of one batch as one float64 vector (float32 on MPS), in the order of :data:`STAT_NAMES`.

    1-D ids are one sequence. Supervised padding is counted only for labels aligned with the ids (``labels_aligned``:
    not an encoder-decoder's). Statistics that do not apply are 0. ``host_reads`` (default: ids on the CPU, where a
    read waits for nothing) reads a few counts on the host to skip kernels; on an accelerator everything stays on the
    device (no sync). Both ways give the same vector.
    """
    with torch.no_grad():
        ids = input_ids if input_ids.ndim >= 2 else input_ids.reshape(1, -1)
        ids = ids.reshape(ids.shape[0], -1).long()
        n, width = ids.shape
        device = ids.device
        acc = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        lazy = (device.type == "cpu" if host_reads is None else host_reads) and ids.numel() > 0
        has_mask = attention_mask is not None and attention_mask.numel() == ids.numel()
        # host reads below (`_read`) happen only when `lazy`: CPU tensors, no device sync
        if has_mask:
            assert attention_mask is not None
            raw_mask = attention_mask.reshape(n, width)
            real = raw_mask != 0
            mask_non_binary, first_mask = _non_binary(raw_mask, real, acc, lazy)
        else:
            mask_non_binary = first_mask = 0
            real = torch.ones_like(ids, dtype=torch.bool)
        lengths = real.sum(1)
        if lazy:  # host_reads: the rows' lengths summed on the host (CPU: no sync), two kernels fewer
            host_lengths = lengths.tolist()
            length_sum: Tensor | int = sum(host_lengths)
            length_sq_sum: Tensor | int = sum(length * length for length in host_lengths)
        else:
            length_sum, length_sq_sum = lengths.sum(), lengths.square().sum()
        labels_part = _label_counts(ids, real, labels, length_sum, vocab_size, ignore_index, labels_aligned, lazy)
        pad_positions = ids.numel() - _read(length_sum) if lazy else (~real).sum()
        values: list[Tensor | float] = [
            n,
            width,
            *_ids_outside(ids, vocab_size, lazy),
            mask_non_binary,
            first_mask,
            *labels_part,
            pad_positions,
            length_sum,
            length_sq_sum,
            *_conventions(ids, real, lengths, bos_id, eos_id, max_length),
        ]
        if has_mask:
            pos_ids = position_ids if position_ids is not None and position_ids.numel() == ids.numel() else None
            values += mask_hole_statistics(ids, real, pos_ids, lengths=lengths, host_reads=lazy)
        else:
            values += [0] * 5 + [-1] * 5 + [0]
        return _pack(values, device, acc, lazy)


def _ids_outside(ids: Tensor, vocab_size: int | None, lazy: bool) -> list[Tensor | int]:
    """``ids_out_of_range``, the first one's row, column and value (-1 when none), ``ids_min`` and ``ids_max`` of the
    2-D ids; with ``lazy`` (host reads allowed) no search when every id is in range."""
    width = ids.shape[1]
    if ids.numel() == 0:
        ids_min = ids_max = 0
    else:
        ids_min, ids_max = torch.aminmax(ids)
    n_bad: Tensor | int = 0
    row: Tensor | int = -1
    col: Tensor | int = -1
    val: Tensor | int = -1
    if vocab_size is not None and not (lazy and _read(ids_min) >= 0 and _read(ids_max) < vocab_size):
        bad = (ids < 0) | (ids >= vocab_size)
        n_bad = bad.sum()
        found = _locate(bad, n_bad, lazy)
        if found is not None:
            first, has = found
            row = _where(has, first // width, -1)
            col = _where(has, first % width, -1)
            val = _where(has, ids.reshape(-1)[first], -1)
    return [n_bad, row, col, val, ids_min, ids_max]


def _label_counts(
    ids: Tensor,
    real: Tensor,
    labels: Tensor | None,
    length_sum: Tensor | int,
    vocab_size: int | None,
    ignore_index: int,
    labels_aligned: bool,
    lazy: bool,
) -> list[Tensor | int]:
    """``labels_total``, ``labels_ignored``, ``labels_out_of_range``, the first of those (0 when none) and
    ``pad_supervised`` (labels aligned with the ids only)."""
    labels_total = labels_ignored = labels_bad = first_lab = pad_supervised = 0
    if labels is None or labels.numel() == 0:
        return [labels_total, labels_ignored, labels_bad, first_lab, pad_supervised]
    lab = labels.reshape(-1).long()
    ignored = lab == ignore_index
    labels_total = lab.numel()
    labels_ignored = ignored.sum()
    if vocab_size is not None:
        in_range = False
        if lazy:  # the labels that are not ignored, all within [0, vocab): nothing to count or locate
            lab_min, lab_max = torch.aminmax(torch.where(ignored, 0, lab))
            in_range = _read(lab_min) >= 0 and _read(lab_max) < vocab_size
        if not in_range:
            bad_lab = ~ignored & ((lab < 0) | (lab >= vocab_size))
            labels_bad = bad_lab.sum()
            found = _locate(bad_lab, labels_bad, lazy)
            if found is not None:
                first, has = found
                first_lab = _where(has, lab[first], 0)
    if labels_aligned and lab.numel() == ids.numel() and not (lazy and _read(length_sum) == ids.numel()):
        # masked and not ignored: every position but those attended or ignored
        pad_supervised = ids.numel() - (real | ignored.reshape(ids.shape)).sum()
    return [labels_total, labels_ignored, labels_bad, first_lab, pad_supervised]


def _conventions(
    ids: Tensor, real: Tensor, lengths: Tensor, bos_id: int | None, eos_id: int | None, max_length: int | None
) -> list[Tensor | int]:
    """``bos_missing``, ``eos_multiple``, ``eos_then_tokens`` and ``truncated`` (0 for a convention not given)."""
    n, width = ids.shape
    if bos_id is not None or eos_id is not None:
        positions = torch.arange(width, device=ids.device).expand(n, width)
    bos_missing: Tensor | int = 0
    if bos_id is not None:
        first_real = torch.where(real, positions, width).amin(1).clamp(max=width - 1)
        first_tok = ids.gather(1, first_real[:, None]).squeeze(1)
        bos_missing = ((first_tok != bos_id) & (lengths > 0)).sum()
    eos_multiple: Tensor | int = 0
    eos_then_tokens: Tensor | int = 0
    truncated: Tensor | int = 0
    if eos_id is not None:
        is_eos = (ids == eos_id) & real
        eos_count = is_eos.sum(1)
        eos_multiple = (eos_count > 1).sum()
        first_eos = torch.where(is_eos, positions, width).amin(1)
        after = real & (positions > first_eos[:, None])
        eos_then_tokens = after.any(1).sum()
        if max_length is not None:
            truncated = ((lengths >= max_length) & (eos_count == 0)).sum()
    return [bos_missing, eos_multiple, eos_then_tokens, truncated]


def _read(value: Tensor | float) -> float:
    """A scalar's value on the host. Called only on the ``host_reads`` path (CPU tensors: no device sync)."""
    return value.item() if isinstance(value, Tensor) else value


def _locate(flags: Tensor, count: Tensor, lazy: bool) -> tuple[Tensor, Tensor | bool] | None:
    """The flat index of the first True of ``flags`` and whether there is one; with ``lazy``, None when ``count`` is 0
    (no search)."""
    if lazy:
        if not count.item():  # the host_reads path: CPU tensors, no device sync
            return None
        return flags.reshape(-1).long().argmax(), True
    return flags.reshape(-1).long().argmax(), count > 0


def _where(has: Tensor | bool, value: Tensor, default: int) -> Tensor:
    """``value`` where ``has`` (known True on the host, or a device flag), else ``default``."""
    return value if has is True else torch.where(has, value, default)


def _non_binary(raw_mask: Tensor, real: Tensor, acc: torch.dtype, lazy: bool) -> tuple[Tensor | int, Tensor | int]:
    """Entries of the mask that are neither 0 nor 1, and the first of them (0 when none)."""
    if raw_mask.dtype == torch.bool:
        return 0, 0  # a boolean mask holds nothing else
    if lazy and not raw_mask.is_floating_point() and not raw_mask.is_complex():
        low, high = torch.aminmax(raw_mask)
        if low.item() >= 0 and high.item() <= 1:  # an integer mask within [0, 1] is binary (host_reads: no sync)
            return 0, 0
    non_binary = real & (raw_mask != 1)
    count = non_binary.sum()
    found = _locate(non_binary, count, lazy)
    if found is None:
        return count, 0
    first, has = found
    return count, _where(has, raw_mask.reshape(-1)[first].to(acc), 0)


def _pack(values: Sequence[Tensor | float], device: torch.device, acc: torch.dtype, lazy: bool) -> Tensor:
    """The statistics as one vector of ``acc`` on ``device``."""
    if lazy:
        # host_reads (CPU): reading the scalars waits for nothing, and one tensor built from host numbers costs less
        # than a conversion kernel per statistic and a stack
        return torch.tensor([_read(v) for v in values], dtype=acc, device=device)
    constants: dict[float, Tensor] = {}
    out = []
    for v in values:
        if isinstance(v, Tensor):
            out.append(v.reshape(()).to(acc))
        else:
            if v not in constants:
                constants[v] = torch.full((), float(v), device=device, dtype=acc)
            out.append(constants[v])
    return torch.stack(out)


_NO_ID = torch.iinfo(torch.int64).min  # a sentinel no token id equals
_ROW_STRIDE = 2**32  # row * stride + id: a key unique per (row, id) for ids below 2**32


def mask_hole_statistics(
    ids: Tensor,
    real: Tensor,
    position_ids: Tensor | None = None,
    *,
    lengths: Tensor | None = None,
    host_reads: bool | None = None,
) -> list[Tensor | int]:
    """How the attention mask ``real`` (bool, ``[rows, width]``) breaks the one-run-per-row shape of padding.

    A *hole* is a masked position inside the text: a 0 between two 1s, or the 0s of the shorter end of a row masked
    at both ends. Holes whose id is attended nowhere mean a mask built from the ids (``input_ids != pad_id``);
    ``position_resets`` (position ids restarting in a row) marks packed rows. ``lengths``: ``real.sum(1)`` when known;
    ``host_reads`` as in :func:`token_statistics`.

    Returns the values ``mask_hole_rows`` to ``position_resets`` of :data:`STAT_NAMES` (device scalars or host ints).
    """
    width = ids.shape[1]
    ids64 = ids.long()
    lazy = (ids.device.type == "cpu" if host_reads is None else host_reads) and ids.numel() > 0
    if lengths is None:
        lengths = real.sum(1)
    masked = ~real & (lengths > 0)[:, None]
    resets = _position_resets(real, position_ids)
    # A row holds a hole exactly when its mask changes value at least twice: one run of padding at one end changes
    # it once (1 1 0 0, 0 0 1 1), a 0 between 1s or padding at both ends twice or more (1 0 1, 0 1 1 0).
    if lazy and (width < 2 or (real[:, 1:] != real[:, :-1]).sum(1).max().item() < 2):  # CPU: no device sync
        # no hole: every masked position is padding
        padding_ids = ids64.masked_select(masked)
        pad_min = pad_max = -1
        if padding_ids.numel():
            low, high = torch.aminmax(padding_ids)
            # as the full path's amax over the row with -1 outside the padding: never below -1
            pad_min, pad_max = low.item(), max(high.item(), -1)
        return [0, 0, 0, 0, 0, -1, -1, -1, pad_min, pad_max, resets]
    return [*_holes(ids64, real, masked, lengths), resets]


def _position_resets(real: Tensor, position_ids: Tensor | None) -> Tensor | int:
    """Attended positions whose position id does not exceed that of an earlier attended position of the row (packed
    rows restart their positions per document); 0 without position ids."""
    if position_ids is None:
        return 0
    p = position_ids.reshape(real.shape).long()
    attended = torch.where(real, p, _NO_ID)
    earlier = torch.cat([torch.full_like(p[:, :1], _NO_ID), attended.cummax(1).values[:, :-1]], 1)
    return (real & (p <= earlier) & (earlier != _NO_ID)).sum()


def _holes(ids64: Tensor, real: Tensor, masked: Tensor, lengths: Tensor) -> list[Tensor]:
    """The hole statistics of :func:`mask_hole_statistics` but the last, on the device (no host sync)."""
    n, width = ids64.shape
    device = ids64.device
    pos = torch.arange(width, device=device).expand(n, width)
    first = torch.where(real, pos, width).amin(1, keepdim=True)
    last = torch.where(real, pos, -1).amax(1, keepdim=True)
    lead, trail = masked & (pos < first), masked & (pos > last)
    both_ends = lead.any(1) & trail.any(1)
    lead_is_hole = lead.sum(1) <= trail.sum(1)  # in a row masked at both ends, the shorter end is not padding
    end_holes = both_ends[:, None] & torch.where(lead_is_hole[:, None], lead, trail)
    holes = (masked & (pos > first) & (pos < last)) | end_holes
    hole_rows = holes.any(1)

    # ids at attended positions, per row and over the batch (sort-based membership: no host sync)
    rows = torch.arange(n, device=device, dtype=torch.int64)[:, None] * _ROW_STRIDE
    keyed = rows + ids64
    no_id = torch.full_like(ids64, _NO_ID)
    in_row = torch.isin(keyed, torch.where(real, keyed, no_id))
    anywhere = torch.isin(ids64, torch.where(real, ids64, no_id))

    flat = holes.reshape(-1)
    first_hole = flat.long().argmax()
    any_hole = flat.any()
    padding = masked & ~holes
    big = torch.iinfo(torch.int64).max
    pad_min = torch.where(padding, ids64, big).amin()
    pad_max = torch.where(padding, ids64, -1).amax()
    pad_min = torch.where(padding.any(), pad_min, -1)
    return [
        hole_rows.sum(),
        holes.sum(),
        torch.where(hole_rows, lengths, 0).sum(),
        (holes & ~anywhere).sum(),
        (holes & in_row).sum(),
        torch.where(any_hole, first_hole // width, -1),
        torch.where(any_hole, first_hole % width, -1),
        torch.where(any_hole, ids64.reshape(-1)[first_hole], -1),
        pad_min,
        pad_max,
    ]


def unpack_statistics(host: Sequence[float]) -> dict[str, float]:
    """Name the entries of a :func:`token_statistics` vector after it reached the host."""
    return dict(zip(STAT_NAMES, host))


def length_shift(reference_mean: float, reference_std: float, window_mean: float, tolerance: float) -> bool:
    """Whether a window's mean length moved from the reference by more than ``tolerance`` of it and one std."""
    if reference_mean <= 0:
        return False
    delta = abs(window_mean - reference_mean)
    return delta > tolerance * reference_mean and delta > reference_std


# ------------------------------------------------------------------------------------------ special-token supervision

SPECIAL_FIELDS: tuple[str, ...] = (
    "real_tokens",  # input positions with attention mask 1
    "supervised",  # labels that are not ignore_index
    "aligned_supervised",  # supervised labels aligned with the ids position for position (0 when not aligned)
    "identity_matches",  # of those, labels equal to the id at the same position (Hugging Face causal-LM labels)
    "shift_matches",  # supervised labels equal to the next position's id (labels shifted by the data)
    "in_inputs",  # per special id (in the order given): its count among the real inputs, a row's first excepted
    "in_labels",  # per special id: its count among the supervised labels
)
"""The fields of :func:`special_token_statistics`: scalars, then two vectors with one entry per special id."""


def special_token_statistics(
    input_ids: Tensor,
    attention_mask: Tensor | None,
    labels: Tensor,
    special_ids: Sequence[int],
    *,
    ignore_index: int = -100,
    labels_aligned: bool = True,
) -> dict[str, Tensor]:
    """How often each of ``special_ids`` occurs among one batch's real inputs (not the first of a row) and supervised
    labels, with what tells a causal LM's labels from a masked LM's: the fields of :data:`SPECIAL_FIELDS` by name. On
    the inputs' device, no host sync.
    """
    with torch.no_grad():
        ids = input_ids if input_ids.ndim >= 2 else input_ids.reshape(1, -1)
        ids = ids.reshape(ids.shape[0], -1).long()
        n, width = ids.shape
        device = ids.device
        acc = torch.float32 if device.type == "mps" else torch.float64
        if attention_mask is not None and attention_mask.numel() == ids.numel():
            real = attention_mask.reshape(n, width) != 0
        else:
            real = torch.ones_like(ids, dtype=torch.bool)
        positions = torch.arange(width, device=device).expand(n, width)
        first_real = torch.where(real, positions, width).amin(1, keepdim=True)
        counted = real & (positions > first_real)
        lab = labels.reshape(-1).long()
        supervised = lab != ignore_index
        zero = torch.zeros((), device=device, dtype=acc)
        if labels_aligned and lab.numel() == ids.numel():
            lab2, sup2 = lab.reshape(n, width), supervised.reshape(n, width)
            aligned = sup2.sum().to(acc)
            identity = (sup2 & (lab2 == ids)).sum().to(acc)
            shift = (sup2[:, :-1] & (lab2[:, :-1] == ids[:, 1:])).sum().to(acc)
        else:
            aligned = identity = shift = zero
        in_inputs = [((ids == token) & counted).sum().to(acc) for token in special_ids]
        in_labels = [((lab == token) & supervised).sum().to(acc) for token in special_ids]
        scalars = (real.sum().to(acc), supervised.sum().to(acc), aligned, identity, shift)
        fields = dict(zip(SPECIAL_FIELDS[:5], (v.reshape(()) for v in scalars), strict=True))
        fields["in_inputs"] = torch.stack(in_inputs) if in_inputs else zero.reshape(1)[:0]
        fields["in_labels"] = torch.stack(in_labels) if in_labels else zero.reshape(1)[:0]
        return fields


# ---------------------------------------------------------------------------------------------------- fingerprints
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


class EpochData(NamedTuple):
    """An epoch's training data (host metadata, read once per epoch).

    Attributes:
        stream: not a map-style DataLoader (no epochs of its own).
        loader_length: batches per epoch before any Trainer limit; None for a stream or several loaders.
        per_epoch: the batches the Trainer reads per epoch.
        setting: the Trainer limit in force (``"Trainer(overfit_batches=1)"``).
        stateful: every loader can restore its position (``state_dict``/``load_state_dict``).
        in_order: every loader reads in a fixed order (no shuffling).
    """

    stream: bool = False
    loader_length: int | None = None
    per_epoch: int | None = None
    setting: str | None = None
    stateful: bool = False
    in_order: bool = False
