"""Pure checks on training batches: schemas from host metadata, and packed token/target statistics.

Nothing here needs a Trainer. Schema functions read only ``dtype``/``shape`` (host metadata, no device sync).
:func:`token_statistics` computes every value statistic of one batch on its device and returns a single 1-D tensor,
so a caller moves them all to the host with one transfer.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_tfdebug.core.batch import flatten_batch, host_array

# ----------------------------------------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class FieldSpec:
    """What one leaf of a batch looks like: ``dtype`` (a torch dtype name, or a Python type name for non-tensors)
    and ``shape`` (``None`` for non-tensors)."""

    dtype: str
    shape: tuple[int, ...] | None

    def describe(self) -> str:
        if self.shape is None:
            return self.dtype
        return f"{self.dtype}[{', '.join(str(s) for s in self.shape)}]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_batch(batch: Any) -> dict[str, FieldSpec]:
    """The :class:`FieldSpec` of every leaf. Host metadata only: no device sync."""
    return describe_leaves(flatten_batch(batch))


def describe_leaves(leaves: Mapping[str, Any]) -> dict[str, FieldSpec]:
    """The :class:`FieldSpec` of every leaf of :func:`flatten_batch`'s output. Host metadata only."""
    out = {}
    for path, value in leaves.items():
        if isinstance(value, Tensor):
            out[path] = FieldSpec(_dtype_name(value.dtype), tuple(value.shape))
        else:  # a list of plain values too: its length is the batch size, not checked
            out[path] = FieldSpec(type(value).__name__, None)
    return out


def structure_key(leaves: Mapping[str, Any]) -> tuple:
    """What :func:`describe_leaves` reads of every leaf (path, dtype and shape of a tensor, type of anything else), as
    one tuple: two batches with equal keys have equal specs. Cheaper than the specs; host metadata only."""
    return tuple(
        (path, value.dtype, value.shape) if isinstance(value, Tensor) else (path, type(value))
        for path, value in leaves.items()
    )


_DECLARED = re.compile(r"^\s*([A-Za-z0-9_]+)\s*(?:\[(.*)\])?\s*$")


@dataclass
class KeySchema:
    """Expected dtype and dimensions of one key.

    ``dims`` holds, per dimension, an int (fixed size), a name (a size shared by every dimension of the batch with
    the same name) or ``None`` (free). ``None`` for ``dims`` means the number of dimensions is not checked.
    """

    dtype: str
    dims: list[int | str | None] | None


@dataclass
class Schema:
    """Expected structure of every batch: a :class:`KeySchema` per key, and whether it was declared or learned."""

    keys: dict[str, KeySchema] = field(default_factory=dict)
    declared: bool = False

    def describe(self) -> dict[str, str]:
        out = {}
        for k, s in self.keys.items():
            dims = "" if s.dims is None else "[" + ", ".join("*" if d is None else str(d) for d in s.dims) + "]"
            out[k] = s.dtype + dims
        return out


def parse_declared_schema(declared: Mapping[str, str]) -> Schema:
    """Parse ``{key: "int64[B, T]"}`` declarations into a :class:`Schema`.

    Each value is a dtype name (``int64``, ``float32``, ``bool`` ...) optionally followed by dimensions in brackets:
    an integer is a fixed size, a name is a size shared by all dimensions of the batch with that name (``T`` in both
    ``input_ids`` and ``labels``), ``*`` is free. Without brackets only the dtype is checked.

    Raises:
        ValueError: on a malformed declaration or an unknown dtype.
    """
    schema = Schema(declared=True)
    for key, text in declared.items():
        match = _DECLARED.match(str(text))
        if not match:
            raise ValueError(f"`schema[{key!r}]` must look like 'int64[B, T]'; got {text!r}.")
        dtype, dims_text = match.group(1), match.group(2)
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"`schema[{key!r}]` names dtype {dtype!r}, which is not a torch dtype (e.g. 'int64').")
        dims: list[int | str | None] | None = None
        if dims_text is not None:
            dims = []
            for part in (p.strip() for p in dims_text.split(",")) if dims_text.strip() else ():
                if part == "*":
                    dims.append(None)
                elif part.isdigit():
                    dims.append(int(part))
                elif part.isidentifier():
                    dims.append(part)
                else:
                    raise ValueError(f"`schema[{key!r}]`: dimension {part!r} must be an integer, a name or '*'.")
        schema.keys[key] = KeySchema(_dtype_name(getattr(torch, dtype)), dims)
    return schema


def learn_schema(specs: Sequence[Mapping[str, FieldSpec]]) -> Schema:
    """Learn a schema from the specs of the first batches.

    Keys and dtypes are those of the first batch; the number of dimensions is pinned; dimension sizes are free,
    except that dimensions whose sizes were equal across keys in *every* batch (``input_ids``, ``attention_mask``
    and ``labels`` share batch and sequence sizes) get a shared name, so a later batch where they disagree is
    caught. Fixed sizes are never learned: a run whose first batches all happen to be padded to the same length
    must not flag the first shorter one.
    """
    first = specs[0]
    schema = Schema()
    # candidate groups: (ndim index) -> keys whose dimension i equalled each other's in every batch
    tensors = [k for k, s in first.items() if s.shape is not None]
    names: dict[tuple[str, int], str] = {}
    for key in tensors:
        for i in range(len(first[key].shape or ())):
            if (key, i) in names:
                continue
            group = [(key, i)]
            for other in tensors:
                for j in range(len(first[other].shape or ())):
                    if (other, j) == (key, i) or (other, j) in names or j != i:
                        continue
                    if all(
                        other in s
                        and key in s
                        and s[other].shape is not None
                        and s[key].shape is not None
                        and len(s[other].shape) > j
                        and len(s[key].shape) > i
                        and s[other].shape[j] == s[key].shape[i]
                        for s in specs
                    ):
                        group.append((other, j))
            if len(group) > 1:
                for member in group:
                    names[member] = f"d{i}:{key}"
    for key, spec in first.items():
        if spec.shape is None:
            schema.keys[key] = KeySchema(spec.dtype, None)
        else:
            schema.keys[key] = KeySchema(spec.dtype, [names.get((key, i)) for i in range(len(spec.shape))])
    return schema


@dataclass(frozen=True)
class Drift:
    """One difference between a batch and the schema.

    ``kind`` is ``"missing"``, ``"extra"``, ``"dtype"``, ``"ndim"`` or ``"size"``.
    """

    kind: str
    key: str
    expected: str
    found: str


def compare_schema(schema: Schema, specs: Mapping[str, FieldSpec]) -> list[Drift]:
    """Every way the batch described by ``specs`` differs from ``schema``."""
    out: list[Drift] = []
    for key, expected in schema.keys.items():
        if key not in specs:
            out.append(Drift("missing", key, expected.dtype, "absent"))
    if not schema.declared:
        for key in specs:
            if key not in schema.keys:
                out.append(Drift("extra", key, "absent", specs[key].describe()))
    sizes: dict[str, tuple[str, int]] = {}
    for key, expected in schema.keys.items():
        spec = specs.get(key)
        if spec is None:
            continue
        if spec.dtype != expected.dtype:
            out.append(Drift("dtype", key, expected.dtype, spec.dtype))
        if expected.dims is None or spec.shape is None:
            continue
        if len(spec.shape) != len(expected.dims):
            want = "[" + ", ".join("*" if d is None else str(d) for d in expected.dims) + "]"
            out.append(Drift("ndim", key, f"{len(expected.dims)} dims {want}", f"{len(spec.shape)} dims {spec.shape}"))
            continue
        for i, (dim, size) in enumerate(zip(expected.dims, spec.shape)):
            if isinstance(dim, int) and size != dim:
                out.append(Drift("size", key, f"dim {i} = {dim}", f"dim {i} = {size} (shape {tuple(spec.shape)})"))
            elif isinstance(dim, str):
                if dim in sizes and sizes[dim][1] != size:
                    other, other_size = sizes[dim]
                    out.append(
                        Drift(
                            "size",
                            key,
                            f"dim {i} = {other_size}, as in {other!r}",
                            f"dim {i} = {size} (shape {tuple(spec.shape)})",
                        )
                    )
                sizes.setdefault(dim, (key, size))
    return out


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
    """All value statistics of one language-model batch as one float64 vector (float32 on MPS, which has no
    float64), in the order of :data:`STAT_NAMES`.

    1-D inputs are treated as one sequence. ``labels`` may have any shape; supervised padding is counted only when
    they align with the ids element for element (and ``labels_aligned``: an encoder-decoder's labels are the
    decoder's targets, unrelated to the encoder's padding even when their widths happen to match). Runs on the
    inputs' device under ``no_grad``. Statistics that do not apply (no mask, no labels, no BOS id) are 0. The mask
    hole statistics are :func:`mask_hole_statistics` (``position_ids`` of the ids' shape tell packed rows apart).

    ``host_reads`` (default: the ids are on the CPU) lets it read a few counts on the host and skip the kernels whose
    result they already give (where the first out-of-range id is, when there is none). On the CPU such a read waits
    for nothing: the values are in host memory and CPU kernels have finished when they return. On an accelerator it
    is left off: kernels run asynchronously and a read would be a device sync, so every statistic is computed on
    the device and the caller moves the vector to the host once. Both ways give the same vector.
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
    ``pad_supervised``. Labels of any shape (seq2seq targets, one class per row) get the range and ignored counts;
    the padding count needs labels aligned with the ids, position for position."""
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
    """The flat index of the first True of ``flags`` and whether there is one (``count > 0``). With ``lazy`` (host
    reads allowed) None when ``count`` is 0, without the search; otherwise the search always runs and the caller masks
    its result with the returned flag."""
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

    Padding fills one end of a row: a right-padded row is ``1 1 1 0 0``, a left-padded one ``0 0 1 1 1``. A *hole* is
    a masked position inside the text: a 0 between two 1s, or, in a row masked at both ends, the 0s of the shorter
    end (``0 1 1 0 0``: the first token is hidden). For the holes, it tells apart a mask built from token identity
    (``input_ids != pad_id`` with a pad id that is also a real token: the hole's id is attended nowhere in the batch)
    from a mask that hides tokens attended elsewhere in the same row. ``position_resets`` counts attended positions
    whose position id does not exceed that of an earlier attended position of the row: packed rows restart their
    positions per document, and their masks may legitimately have holes.

    ``lengths`` is ``real.sum(1)`` when the caller has it. ``host_reads`` (default: the ids are on the CPU, where a
    read is no device sync) first asks whether any row has a hole at all, and when none has, skips the kernels that
    describe holes; on an accelerator everything runs on the device, with no host sync.

    Returns the values named ``mask_hole_rows`` to ``position_resets`` in :data:`STAT_NAMES`: device scalars, or
    ints where ``host_reads`` already knew them.
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
    """Whether a window's mean sequence length moved away from the reference by more than ``tolerance`` of the
    reference mean (and by more than one reference standard deviation, so noisy small batches do not trip it)."""
    if reference_mean <= 0:
        return False
    delta = abs(window_mean - reference_mean)
    return delta > tolerance * reference_mean and delta > reference_std


# ------------------------------------------------------------------------------------------ special-token supervision

SPECIAL_HEAD: tuple[str, ...] = (
    "real_tokens",  # input positions with attention mask 1
    "supervised",  # labels that are not ignore_index
    "aligned_supervised",  # supervised labels aligned with the ids position for position (0 when not aligned)
    "identity_matches",  # of those, labels equal to the id at the same position (Hugging Face causal-LM labels)
    "shift_matches",  # supervised labels equal to the next position's id (labels shifted by the data)
)
"""The leading entries of :func:`special_token_statistics`; then two per special id: ``(in inputs, supervised)``."""


def special_token_statistics(
    input_ids: Tensor,
    attention_mask: Tensor | None,
    labels: Tensor,
    special_ids: Sequence[int],
    *,
    ignore_index: int = -100,
    labels_aligned: bool = True,
) -> Tensor:
    """How often each of ``special_ids`` occurs among the real input tokens and among the supervised labels of one
    batch, with what tells a causal-LM batch from a masked-LM one; one float64 vector (float32 on MPS) in the order of
    :data:`SPECIAL_HEAD`, then ``(in inputs, supervised)`` per special id.

    A special token is counted among the inputs where the attention mask is 1 and it is not the first real token of
    its row (a BOS, or an EOS used as BOS, need not be predicted). Labels are counted wherever they are supervised,
    whatever their alignment (Hugging Face labels equal to the ids, labels shifted by the data, a decoder's targets).
    When the labels align with the ids element for element (and ``labels_aligned``), ``identity_matches`` and
    ``shift_matches`` count the supervised labels equal to the id at the same position or at the next one: a causal
    LM's labels match one way almost everywhere, a masked LM's (the original token where the input is the mask token)
    mostly neither. Runs on the inputs' device under ``no_grad``; no host sync.
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
        values = [real.sum().to(acc), supervised.sum().to(acc), aligned, identity, shift]
        for token in special_ids:
            values.append(((ids == token) & counted).sum().to(acc))
            values.append(((lab == token) & supervised).sum().to(acc))
        return torch.stack([v.reshape(()) for v in values])


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
    """The fingerprint of a CPU tensor, read on the host: the CRC-32 of its bytes, in ``[0, 2**31 - 1)``; None when
    ``ids`` is not a CPU tensor NumPy can read (then :func:`batch_fingerprint` hashes it on its device).

    A CPU batch is host memory already, so hashing its bytes needs no torch kernel: about half the host time of the
    device formula's four kernels on the hot path, where BatchGuard fingerprints every batch. Equal values of one dtype
    give equal fingerprints, as on a device; the two formulas give different numbers, and a run uses one of them (its
    batches are on one kind of device), so its fingerprints compare with each other, across steps and ranks.
    """
    array = host_array(ids)
    if array is None:
        return None
    if not array.flags.c_contiguous:
        array = array.copy()  # a strided view: its elements in order (the CRC reads one contiguous buffer)
    return zlib.crc32(array) % _HASH_MODULUS


def batch_fingerprint(ids: Tensor) -> Tensor:
    """A cheap, order-sensitive hash of a tensor's values as an int64 scalar in ``[0, 2**31 - 1)``: on the host for
    a CPU tensor (:func:`host_fingerprint`), else computed on its device (no sync).

    Two equal tensors always give the same value; different ones collide with probability about 1 in 2**31. Floating
    tensors are hashed through their bit pattern. On a device: three kernels on integer ids, a weighted sum with
    cached position weights, a cached constant added, the remainder.
    """
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
