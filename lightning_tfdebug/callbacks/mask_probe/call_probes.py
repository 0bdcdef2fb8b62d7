"""Probing a model through the call its ``training_step`` makes
(a :class:`~lightning_tfdebug.primitives.calls.ModelCall`), or through its forward by signature
(:class:`ModelCaller`); logits are read back as ``(batch, time, vocab)``.

A token tensor ("slot") whose position ``t`` carries label ``t - offset`` must not reach output ``p`` from any
position ``t >= p + shift + offset``; slots unrelated to the labels, and an encoder's input, are never perturbed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tfdebug.callbacks.mask_probe.leak_checks import LeakReading, LeakSummary, RepeatReading
from lightning_tfdebug.callbacks.mask_probe.position_checks import PositionTable, PositionTablesReading
from lightning_tfdebug.callbacks.mask_probe.readings import Reading
from lightning_tfdebug.functional.probes import causal_valid_positions, logit_tolerance, max_change, other_ids
from lightning_tfdebug.primitives.batch import MASK_KEYS, logits_of
from lightning_tfdebug.primitives.calls import ModelCall, Path, TableUse, TokenSlot, read_logits


class CallError(RuntimeError):
    """The model could not be called the way MaskProbe tried, or did not return logits."""


# -------------------------------------------------------------------------------------- calling the model by signature
@dataclass(frozen=True)
class ModelCaller:
    """How to call the model with ``(input_ids, attention_mask)``: ``call`` does it; ``takes_mask`` says whether
    the mask reaches the model; ``mask_named`` whether the forward names a mask argument (not only ``**kwargs``)."""

    call: Callable[[Tensor, Tensor | None], Any]
    takes_mask: bool
    mask_named: bool


def build_caller(
    module: nn.Module,
    forward_fn: Callable[..., Any] | None = None,
    input_key: str | None = None,
    mask_key: str | None = None,
) -> ModelCaller | str:
    """A :class:`ModelCaller` for ``module`` (``forward_fn(module, input_ids, attention_mask)``, else by the forward's
    signature: see ``docs/callbacks/mask_probe.md``), or a sentence saying why it cannot be called."""
    if forward_fn is not None:
        fn = forward_fn
        return ModelCaller(lambda ids, mask: fn(module, ids, mask), takes_mask=True, mask_named=True)
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "the signature of `forward` cannot be read; set `forward_fn`."
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = (mask_key, *MASK_KEYS) if mask_key is not None else MASK_KEYS
    mask_name = next((n for n in names if n in params), None)
    mask_named = mask_name is not None
    if mask_name is None and var_kw:
        mask_name = mask_key or "attention_mask"
    id_name: str | None = None  # None: the ids go first, positionally
    if (input_key is not None and input_key in params) or "input_ids" in params or var_kw:
        id_name = input_key if input_key is not None and (input_key in params or var_kw) else "input_ids"
    elif not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params.values()):
        return "`forward` takes neither `input_ids` by keyword nor the ids positionally; set `forward_fn`."

    def call(ids: Tensor, mask: Tensor | None) -> Any:
        kwargs = {mask_name: mask} if mask_name is not None and mask is not None else {}
        return module(ids, **kwargs) if id_name is None else module(**{id_name: ids, **kwargs})

    return ModelCaller(call, takes_mask=mask_name is not None, mask_named=mask_named)


def caller_logits(caller: ModelCaller, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The logits ``(B, T, V)`` of ``caller`` on ``input_ids`` (the mask only when it reaches the model).

    Raises:
        CallError: when the output holds no logits of that shape.
    """
    logits = logits_of(caller.call(input_ids, attention_mask if caller.takes_mask else None))
    if logits is None or logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        shape = None if logits is None else tuple(logits.shape)
        raise CallError(f"the model's output is not logits of shape (batch, time, vocab) (got {shape})")
    return logits


# ------------------------------------------------------------------------------------------------- re-issuing the call
def call_vocab(found: ModelCall, input_ids: Tensor) -> Tensor:
    """The distinct, sorted, non-negative ids of the batch and the call's token tensors: replacements come from them."""
    values = [input_ids.flatten()] + [found.tensors[s.path].flatten() for s in found.slots]
    vocab = torch.unique(torch.cat([v.to(input_ids.device, input_ids.dtype) for v in values]))
    vocab = vocab[vocab != found.ignore_index]
    return vocab[vocab >= 0]


def random_ids(vocab: Tensor, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Ids of ``shape`` drawn from ``vocab`` with ``generator`` (on the CPU, then moved to ``vocab``'s device)."""
    idx = torch.randint(0, vocab.numel(), shape, generator=generator, device="cpu").to(vocab.device)
    return vocab[idx]


def run_call(found: ModelCall, changes: dict[Path, Tensor], rows: int | None = None) -> Tensor:
    """Call again with the slots at ``changes`` replaced (batch-first ``(b, t)`` tensors, converted to each slot's
    layout), every other batch-shaped tensor cut to ``rows``; returns the logits ``(b, T_out, V)``.

    Raises:
        ValueError: when the call returns no logits for the probe's rows.
    """
    b = rows or found.batch_size
    replacements: dict[Path, Tensor] = {}
    for path, value in found.tensors.items():
        seq_first = found.seq_first_at(path) and value.ndim >= 2
        if path in changes:
            new = changes[path]
            if seq_first:
                new = new.transpose(0, 1)
            replacements[path] = new.to(value.dtype) if path == found.mask_path else new
        elif b != found.batch_size:
            axis = 1 if seq_first else 0
            if value.ndim > axis and value.shape[axis] == found.batch_size:
                replacements[path] = value.narrow(axis, 0, b)
    logits = read_logits(found.call.call(replacements), b, found.out_seq_first)
    if logits is None:
        raise ValueError("the recorded call did not return logits for the probe's rows")
    return logits


def call_logits(
    found: ModelCall, vocab: Tensor, input_ids: Tensor, attention_mask: Tensor | None, generator: torch.Generator
) -> Tensor:
    """The recorded call with its token ids (and mask) replaced by ``input_ids`` (and ``attention_mask``); every other
    tensor of the ids' length along its sequence axis (:meth:`ModelCall.sequence_group`: a decoder input, its mask,
    labels, per-position features, by keyword or positionally) follows: cut to the same rows and length, or extended
    (:func:`extended`). Tensors of another length (an encoder-decoder's other side) are left as they are. The
    probes' logits function for a recorded call."""
    primary = found.primary
    assert primary is not None
    b, t = input_ids.shape
    changes: dict[Path, Tensor] = {primary.path: input_ids}
    if found.mask_path is not None and attention_mask is not None:
        changes[found.mask_path] = found.mask_value(attention_mask)
    for path in found.sequence_group(primary.length, exclude=primary.path):
        if path in changes:
            continue
        value = found.tensors[path]
        member = (value.transpose(0, 1) if found.seq_first_at(path) else value)[:b, :t].contiguous()
        changes[path] = extended(found, path, member, t, vocab, generator) if member.shape[1] < t else member
    return run_call(found, changes, rows=b)


def extended(
    found: ModelCall, path: Path, member: Tensor, length: int, vocab: Tensor, generator: torch.Generator
) -> Tensor:
    """``member`` (batch-first) extended to ``length`` positions: token ids and labels with ids from ``vocab`` (a class
    every loss accepts, whatever its ignored value), anything else (a 0/1 mask, features) with copies of its last
    position."""
    b, extra = int(member.shape[0]), length - int(member.shape[1])
    slot = next((s for s in found.slots if s.path == path), None)
    if slot is not None and member.ndim == 2 and bool(((member != 0) & (member != 1)).any()):  # not a 0/1 mask
        tail = random_ids(vocab, (b, extra), generator).to(member.dtype)
    else:
        tail = member[:, -1:].expand(b, extra, *member.shape[2:])
    return torch.cat([member, tail], 1)


def perturb_from(
    found: ModelCall, vocab: Tensor, slot: TokenSlot, start: int, rows: int, generator: torch.Generator
) -> Tensor | None:
    """The slot's first ``rows`` rows (batch-first) with every supervised position from ``start`` on replaced by
    another id; None when there is nothing to replace."""
    out = found.batch_first(slot)[:rows].clone()
    if start >= out.shape[1] or vocab.numel() < 2:
        return None
    tail = out[:, start:]
    out[:, start:] = torch.where(tail == found.ignore_index, tail, other_ids(vocab, tail, generator))
    return out


# ------------------------------------------------------------------------------------------------------------ leaks
def measure_leaks(found: ModelCall, vocab: Tensor, rows: int, generator: torch.Generator) -> list[Reading]:
    """The repeat reading, one leak reading per argument that carries the labels (its tokens replaced from the first
    position an output up to the middle must not see), and their summary."""
    base = run_call(found, {}, rows=rows)
    tolerance = logit_tolerance(base)
    repeat, where = max_change(base, run_call(found, {}, rows=rows))
    out: list[Reading] = [RepeatReading(repeat, where[0], where[1], tolerance)]
    length = int(base.shape[1])
    if length < 2:
        return out
    cut = length // 2 - 1  # the middle: the last position whose outputs must not see the replaced tokens
    valid = causal_valid_positions(rows, length, cut, base.device)
    changes: list[Tensor] = []
    dependence: list[Tensor] = []
    for slot in found.related():
        assert slot.offset is not None
        start = max(0, cut + found.shift + slot.offset)
        perturbed = perturb_from(found, vocab, slot, start, rows, generator)
        if perturbed is None:
            continue
        changed = run_call(found, {slot.path: perturbed}, rows=rows)
        if changed.shape != base.shape:
            continue
        change, where = max_change(base, changed, valid)
        changes.append(change)
        if not slot.primary:  # do the outputs follow this sequence at all (a decoder input)?
            dependence.append(max_change(base, changed)[0])
        out.append(
            LeakReading(
                change, where[0], where[1], cut, start, slot.name, slot.offset, slot.primary, found.shift, tolerance
            )
        )
    largest = torch.stack(changes).max() if changes else None
    out.append(LeakSummary(largest, torch.stack(dependence).max() if dependence else None, tolerance))
    return out


# ---------------------------------------------------------------------------------------------------- position tables
_LAYER_TENSORS = ("weight", "bias")


def watched_tables(model: nn.Module) -> dict[str, Tensor]:
    """The tensors that may be a token or position table, by name: every ``nn.Embedding``'s weight, and every 2-D or
    ``(1, rows, width)`` parameter a module outside ``torch.nn`` holds itself (``self.pos = nn.Parameter(...)``)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            out[f"{name}.weight" if name else "weight"] = module.weight
            continue
        if type(module).__module__.startswith("torch.nn"):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if pname in _LAYER_TENSORS or not (param.ndim == 2 or (param.ndim == 3 and param.shape[0] == 1)):
                continue
            out[f"{name}.{pname}" if name else pname] = param
    return out


def constant_along_sequence(indices: Tensor) -> Tensor | None:
    """A device bool: every row of ``indices`` holds one value along its last (sequence) dimension; None when that
    dimension has one position or fewer (nothing to vary)."""
    if indices.ndim == 0 or indices.shape[-1] < 2:
        return None
    return (indices == indices[..., :1]).all()


def measure_tables(named: dict[str, Tensor], use: TableUse, input_ids: Tensor) -> PositionTablesReading | None:
    """The position tables one watched forward pass of ``input_ids`` used: every table of the token table's width
    with at least ``input_ids.shape[1]`` rows, whether it was read and whether every lookup of it along the sequence
    was constant. None when no table took the token ids or none fits. Host sync: probe steps only."""
    length = input_ids.shape[1]
    token_ids = {
        i for i, idx in use.lookups if idx.shape == input_ids.shape and torch.equal(idx.to(input_ids.device), input_ids)
    }
    token_table = next((name for name, t in named.items() if id(t) in token_ids), None)
    if token_table is None:
        return None  # no lookup of the call's token ids: the token table's width is unknown
    readings: list[PositionTable] = []
    for name, t in named.items():
        rows, width = int(t.shape[-2]), int(t.shape[-1])  # (R, d) or (1, R, d)
        if id(t) in token_ids or width != named[token_table].shape[-1] or rows < length:
            continue
        flags = [c for i, idx in use.lookups if i == id(t) and (c := constant_along_sequence(idx)) is not None]
        constant = torch.stack(flags).all() if flags else False
        readings.append(PositionTable(name, rows, id(t) in use.read, bool(flags), constant))
    return PositionTablesReading(tuple(readings), int(length), token_table) if readings else None
